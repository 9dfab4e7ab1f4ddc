"""Documents from a local file/folder or a HF hub dataset, streamed with HF `datasets`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from titan.config import ConfigError, Data

_FORMAT_BY_SUFFIX = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _local_files(source: Path, fmt: str) -> tuple[str, list[str]]:
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    if fmt == "auto":
        formats = {_FORMAT_BY_SUFFIX.get(p.suffix) for p in files} - {None}
        if len(formats) != 1:
            raise ConfigError(
                f"data.source: cannot tell the format of {source} (found {sorted(formats) or 'no .txt/.jsonl/.json/.parquet files'}); "
                "set data.format to text, json or parquet"
            )
        fmt = formats.pop()
    files = [str(p) for p in files if _FORMAT_BY_SUFFIX.get(p.suffix) == fmt] if source.is_dir() else [str(source)]
    if not files:
        raise ConfigError(f"data.source: no {fmt} files in {source}")
    return fmt, files


def open_documents(cfg: Data):
    """A streaming HF IterableDataset of records; errors name the recipe key at fault."""
    import datasets

    datasets.disable_progress_bars()
    source = Path(cfg.source)
    looks_local = source.exists() or cfg.source.startswith((".", "/", "~")) or source.suffix in _FORMAT_BY_SUFFIX
    if cfg.format != "hub" and looks_local:
        if not source.exists():
            raise ConfigError(f"data.source: file or folder not found: {source}")
        fmt, files = _local_files(source, cfg.format)
        if all(Path(f).stat().st_size == 0 for f in files):
            raise ConfigError(f"data.source: {cfg.source} has no documents (empty files)")
        try:
            return datasets.load_dataset(fmt, data_files={cfg.split: files}, split=cfg.split, streaming=True)
        except Exception as e:
            raise ConfigError(f"data.source: could not read {cfg.source} as {fmt}: {_first_line(e)}") from None
    try:
        return datasets.load_dataset(cfg.source, cfg.subset or None, split=cfg.split, streaming=True)
    except Exception as e:  # offline, unknown name, bad split: all surface as assorted exception types
        raise ConfigError(
            f"data.source: could not open hub dataset {cfg.source!r} (split {cfg.split!r}): {_first_line(e)}. "
            "Without internet, use a local file or a dataset already in the HF cache"
        ) from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def iter_texts(dataset, cfg: Data) -> Iterator[str]:
    for record in dataset:
        if cfg.text_field not in record:
            raise ConfigError(
                f"data.text_field: records of {cfg.source} have no field {cfg.text_field!r}; fields: {', '.join(record)}"
            )
        text = record[cfg.text_field]
        if not isinstance(text, str):
            raise ConfigError(f"data.text_field: {cfg.text_field!r} of {cfg.source} holds {type(text).__name__}, not text")
        yield text
