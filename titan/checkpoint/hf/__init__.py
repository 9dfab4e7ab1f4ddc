"""Hugging Face checkpoints in and out of titan: `titan convert hf-to-dcp | dcp-to-hf`, and `checkpoint.init_from_hf`.

An HF checkpoint is a folder with `config.json` and the weights as `model.safetensors`, or as shards
`model-0000i-of-0000n.safetensors` listed in `model.safetensors.index.json`. Only safetensors are read or
written (no pickle). The model family's `HFAdapter` (titan/models/__init__.py) maps configs and weights tensor
by tensor, including Llama's q/k RoPE rows; this package does the files, the checks and the sharded copies.
Import and export never hold the whole model in one process, so they scale with it: a 70B model is 140 GB of
bf16 files, which read whole by each of a node's 8 ranks would take 1.1 TB; read per rank, 140 GB in all.

* init_from_hf loads an HF folder straight into the trainer's model, sharded or not: the headers are checked
  against config.json and the recipe, then every rank reads, per parameter, one slice of the file (the box around
  the rows and columns its shard holds) and copies its elements out of it.
* hf-to-dcp reads the same way into full fp32 tensors and writes a titan checkpoint folder (the layout of
  titan/checkpoint/format/) holding only the model: DCP shards with keys `model.<fqn>`, `train_state.json` at
  step 0, and the COMPLETE marker, written under a temporary name and renamed. Train from it with
  `checkpoint.resume = <folder>` and `load_only = ["model"]`. (It holds the model, in one process.)
* dcp-to-hf exports the model part of any titan checkpoint (whatever layout saved it): the output files are
  planned from the checkpoint's metadata (huggingface_hub's shard split), then each is filled by loading just its
  tensors from DCP, written, and freed before the next. `config.json` plus safetensors shards, with an index when
  there are several, the recipe's tokenizer as transformers' AutoTokenizer and generate read it (padding with
  EOS), and a model card (README.md) of the run. `--push-to-hub` then uploads the folder (titan/tools/upload.py).
  `titan generate` reads a checkpoint's model alike (open_model_checkpoint, then load_tensors into its own
  parameters, a layer at a time).

init_from_hf and dcp-to-hf report the peak host memory they added (`PeakMemory`, memory.py).

files.py: HF folders (config.json, the weights and their index), checked, and read a shard's box at a time;
imports.py: hf-to-dcp and init_from_hf; exports.py: a titan checkpoint's model and tokenizer, and dcp-to-hf;
card.py: the export's model card;
match.py: which recipe model an HF checkpoint is.
"""

from titan.checkpoint.hf.exports import (
    DEFAULT_MAX_SHARD_SIZE,
    ModelCheckpoint,
    checkpoint_tokenizer,
    dcp_to_hf,
    load_tensors,
    open_model_checkpoint,
    parse_size,
    write_tokenizer_files,
)
from titan.checkpoint.hf.files import (
    CONFIG_FILE,
    FLOAT_WEIGHTS,
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILES,
    WEIGHT_INDEX,
    HFFolder,
    copy_tokenizer_files,
    hf_spec,
    hf_weight_files,
    open_hf,
    read_hf_config,
    read_into,
    read_part,
)
from titan.checkpoint.hf.imports import hf_to_dcp, init_from_hf
from titan.checkpoint.hf.memory import PeakMemory

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_SIZE",
    "FLOAT_WEIGHTS",
    "INDEX_FILE",
    "SINGLE_FILE",
    "TOKENIZER_FILES",
    "WEIGHT_INDEX",
    "HFFolder",
    "ModelCheckpoint",
    "PeakMemory",
    "checkpoint_tokenizer",
    "copy_tokenizer_files",
    "dcp_to_hf",
    "hf_spec",
    "hf_to_dcp",
    "hf_weight_files",
    "init_from_hf",
    "load_tensors",
    "open_hf",
    "open_model_checkpoint",
    "parse_size",
    "read_hf_config",
    "read_into",
    "read_part",
    "write_tokenizer_files",
]
