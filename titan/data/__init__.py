from titan.config import Config, ConfigError
from titan.data.dataset import iter_texts, open_documents
from titan.data.loader import PackedLoader
from titan.data.tokenizer import Tokenizer


def build_loader(config: Config, tokenizer: Tokenizer, dp_rank: int = 0, dp_size: int = 1) -> PackedLoader:
    dataset = open_documents(config.data)
    # Read the first record now, so an empty dataset or a wrong text field fails before any training starts.
    if next(iter_texts(dataset, config.data), None) is None:
        raise ConfigError(f"data.source: {config.data.source} has no documents")
    return PackedLoader(
        texts=lambda: iter_texts(dataset, config.data),
        encode=tokenizer.encode,
        seq_len=config.training.seq_len,
        batch_size=config.training.local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        source_name=config.data.source,
    )
