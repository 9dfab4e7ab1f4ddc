"""Hugging Face folders: the files (config.json, safetensors weights and their index), their checks against each
other, reading a tensor's part (a shard's box) into the model, and writing a folder atomically."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from titan import models
from titan.checkpoint.hf.block_fp8 import FP8_WEIGHTS, BlockScale, block_scales, dequantize
from titan.checkpoint.train_state import buffer_shapes, model_shapes
from titan.config import Tokenizer
from titan.errors import ConfigError
from titan.progress import Progress
from titan.schema import FILE_NAME, MapOf, Table, read_json

log = logging.getLogger("titan")

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# An index names each tensor's file: a plain file name, so that every file read is one of the folder's own.
WEIGHT_INDEX = Table({"weight_map": MapOf(FILE_NAME, filled=True)}, required=frozenset({"weight_map"}))
# A model's tokenizer as transformers reads it; tokenizer.json is what titan reads, the others say its BOS and EOS.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# The safetensors dtypes of weights titan reads (as floats, cast to the model's dtype); an integer tensor is not one.
FLOAT_WEIGHTS = ("F64", "F32", "BF16", "F16")


# ---------------------------------------------------------------------------------------------------------------
# Reading an HF folder: its headers first, then tensors a slice at a time
# ---------------------------------------------------------------------------------------------------------------


def hf_spec(model_name: str) -> models.ModelSpec:
    try:
        spec = models.get_model_spec(model_name)
    except KeyError as e:
        raise ConfigError(str(e).strip("'\"")) from None
    if spec.hf is None:
        raise ConfigError(f"model {model_name} has no Hugging Face conversion")
    return spec


def own_file(folder: Path, name: str) -> Path | None:
    """`folder`'s file `name` (None where it has none), refused in one line unless it is a regular file of the folder:
    a link may lead only into the folder, or for a hub snapshot (`.../snapshots/REV/`) into its repository's
    blobs. A link out (to /proc/self/environ, a key, another user's file) would copy what it leads to into what
    titan writes."""
    path = Path(folder) / name
    if not path.exists() and not path.is_symlink():
        return None
    target, home = path.resolve(), Path(folder).resolve()
    allowed = [home] + ([home.parent.parent / "blobs"] if home.parent.name == "snapshots" else [])
    if not any(target.is_relative_to(place) for place in allowed):
        raise ConfigError(f"{path} leads outside its folder (to {target}): titan reads only the folder's own files; "
                          "replace the link with the file itself")  # fmt: skip
    if not target.is_file():
        raise ConfigError(f"{path} is not a regular file")
    return path


def read_hf_config(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ConfigError(f"HF checkpoint folder {folder} {what}")
    path = own_file(folder, CONFIG_FILE)
    if path is None:
        raise ConfigError(
            f"{folder} has no {CONFIG_FILE}: not a Hugging Face model folder (config.json + *.safetensors)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return config


def hf_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer of HF folder `folder` as a recipe's [tokenizer]: its tokenizer.json, framing documents with the
    BOS and EOS its tokenizer_config.json (else special_tokens_map.json) names; None without a tokenizer.json."""
    folder = Path(folder)
    if own_file(folder, TOKENIZER_FILES[0]) is None:
        return None
    special: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter's wins
        content = tokenizer_file_json(folder, name)
        for key in ("bos_token", "eos_token") if isinstance(content, dict) else ():
            token = content.get(key)
            token = token.get("content") if isinstance(token, dict) else token  # an AddedToken, serialised
            if isinstance(token, str) and token:
                special[key] = token
    default = Tokenizer()
    path = folder.absolute() / TOKENIZER_FILES[0]  # not resolved: a hub snapshot's files are links to its blobs
    if "eos_token" in special:  # the files name the specials: a tokenizer without a BOS (Qwen's) starts with none
        return Tokenizer(str(path), special.get("bos_token", ""), special["eos_token"])
    return Tokenizer(str(path), special.get("bos_token", default.bos_token), default.eos_token)


def tokenizer_file_json(folder: Path, name: str) -> Any:
    """The JSON of HF folder `folder`'s tokenizer file `name` (one of TOKENIZER_FILES; None where it has none),
    refused in one line where it leads outside the folder or does not parse."""
    path = own_file(folder, name)
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}): the folder's tokenizer is damaged") from None


def copy_tokenizer_files(folder: Path, out: Path) -> list[str]:
    """Copy HF folder `folder`'s TOKENIZER_FILES that it has into `out`, each checked to be the folder's own and to
    parse; returns their names."""
    names = [name for name in TOKENIZER_FILES if tokenizer_file_json(folder, name) is not None]
    for name in names:
        shutil.copyfile(Path(folder) / name, Path(out) / name)
    return names


def hf_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of an HF folder: those its index names, or the single `model.safetensors`."""
    folder = Path(folder)
    index = own_file(folder, INDEX_FILE)
    if index is not None:
        try:
            weight_map = read_json(index, WEIGHT_INDEX)["weight_map"]
        except (OSError, ValueError) as e:
            raise ConfigError(f"{folder}: {e}") from None
        files = {name: own_file(folder, name) for name in dict.fromkeys(weight_map.values())}
        missing = [name for name, file in files.items() if file is None]
        if missing:
            raise ConfigError(f"{index} names files that are missing: {', '.join(missing)}")
        return list(files.values())
    if (single := own_file(folder, SINGLE_FILE)) is not None:
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return [own_file(folder, f.name) for f in found]
    pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
    hint = (
        (
            f" (it has {', '.join(pickled[:3])}: pickle files, which titan does not read; convert them to safetensors "
            "with transformers' save_pretrained)"
        )
        if pickled
        else ""
    )
    raise ConfigError(f"{folder} has no *.safetensors weights{hint}")


def _read_headers(folder: Path) -> tuple[dict[str, Path], dict[str, list[int]], dict[str, str]]:
    """({HF tensor: its file}, {HF tensor: shape}, {HF tensor: safetensors dtype}) from the safetensors headers; no
    tensor is read."""
    from safetensors import SafetensorError, safe_open

    files: dict[str, Path] = {}
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for file in hf_weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in files:
                        raise ConfigError(f"tensor {name} appears in more than one file of {folder}")
                    part = f.get_slice(name)
                    if part.get_dtype() not in FLOAT_WEIGHTS + FP8_WEIGHTS:
                        raise ConfigError(
                            f"{file}: tensor {name} is {part.get_dtype()}, not weights titan reads "
                            f"({', '.join(FLOAT_WEIGHTS + FP8_WEIGHTS)})"
                        )
                    files[name], shapes[name], dtypes[name] = file, list(part.get_shape()), part.get_dtype()
        except SafetensorError as e:
            raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None
    return files, shapes, dtypes


def stacked(hf_name: str | tuple[str, ...]) -> tuple[str, ...]:
    """The HF tensors behind a titan parameter, from its source's name (see HFAdapter): one, or those it stacks."""
    return (hf_name,) if isinstance(hf_name, str) else hf_name


def hf_shapes(hf_name: str | tuple[str, ...], shape: list[int]) -> dict[str, list[int]]:
    """The shape of each HF tensor behind a titan parameter of `shape`: its own, or a stack's dim 0 less."""
    return {hf_name: shape} if isinstance(hf_name, str) else {name: shape[1:] for name in hf_name}


def held_shapes(spec: models.ModelSpec, args, sources: dict) -> dict[str, list[int]]:
    """The shapes of what the HF files hold, by titan name: every parameter, and the buffers `sources` names (a
    DeepSeek-V3 router's bias)."""
    buffers = {name: shape for name, shape in buffer_shapes(spec, args).items() if name in sources}
    return {**model_shapes(spec, args), **buffers}


@dataclass(frozen=True)
class HFFolder:
    """An HF checkpoint as its config and file headers describe it, checked against each other (`open_hf`);
    its tensors are read later, only the parts a process needs (`read_into`)."""

    path: Path
    args: Any  # the model's args, from config.json
    files: dict[str, Path]  # HF tensor -> the file holding it
    # titan parameter -> (HF tensor, or the tensors it stacks; rows): the adapter's mapping
    sources: dict[str, tuple[str | tuple[str, ...], Tensor | None]]
    copies: dict[str, str]  # tied copies the files hold -> the HF tensor each must equal
    scales: dict[str, BlockScale]  # FP8 weights -> their block scales
    dtypes: str  # the files' dtypes, for reports


def open_hf(folder: Path, spec: models.ModelSpec) -> HFFolder:
    """The HF folder's config and file headers, checked against each other: ConfigError naming the difference."""
    folder = Path(folder)
    config = read_hf_config(folder)
    try:
        args = spec.hf.args_from_config(config)
    except (ValueError, KeyError, TypeError) as e:
        what = f"lacks {e}" if isinstance(e, KeyError) else str(e)
        raise ConfigError(f"{folder / CONFIG_FILE}: {what}") from None
    files, shapes, dtypes = _read_headers(folder)
    if spec.hf.held_args is not None:
        args, note = spec.hf.held_args(args, files)
        if note:
            log.info("%s: %s", folder, note)
    sources = spec.hf.sources(args)
    try:
        scales = block_scales(config, shapes, dtypes)
        copies = spec.hf.check_names(set(files) - {scale.name for scale in scales.values()}, args)
        expected = {}
        for name, shape in held_shapes(spec, args, sources).items():
            expected.update(hf_shapes(sources[name][0], shape))
        expected.update({copy: expected[original] for copy, original in copies.items()})
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise ValueError(f"{name} has shape {shapes[name]}, but the config makes it {shape}")
    except ValueError as e:
        raise ConfigError(f"{folder}: the weights do not match its {CONFIG_FILE}: {e}") from None
    return HFFolder(folder, args, files, sources, copies, scales, ", ".join(sorted(set(dtypes.values()))))


def _shard_index(name: str, param: Tensor) -> tuple[Tensor, list[Tensor]]:
    """(the tensor this process holds of `param`, per dim the global indices of its elements): all of a plain
    tensor; of a DTensor, the local shard, which is the cross product of those index vectors (see ShardIndex)."""
    from torch.distributed.tensor import DTensor

    from titan.rng.shards import ShardIndex

    if not isinstance(param, DTensor):
        return param, [torch.arange(n) for n in param.shape]
    local = param._local_tensor  # to_local() would go through autograd
    coord = param.device_mesh.get_coordinate()
    if coord is None:  # a rank outside the mesh holds nothing
        return local, []
    shard = ShardIndex(param.shape, param.device_mesh.shape, coord, param.placements)
    if tuple(local.shape) != shard.local_shape:
        raise ConfigError(
            f"parameter {name}: cannot copy a {list(shard.local_shape)} part into a {list(local.shape)} shard"
        )
    return local, [torch.arange(n) if v is None else v for n, v in zip(param.shape, shard.vecs)]


def _read_slice(file: Path, name: str, slices: tuple[slice, ...]) -> Tensor:
    """HF tensor `name`'s elements in `slices`, read from `file`."""
    from safetensors import SafetensorError, safe_open

    try:
        # Opened per read: the tensors safetensors returns map the file, and every page a read touched stays
        # resident while the file is open, which across reads would add up to this process's whole share.
        with safe_open(str(file), framework="pt") as f:
            return f.get_slice(name)[slices]
    except SafetensorError as e:
        raise ConfigError(f"{file} is not a valid safetensors file: {e}") from None


def _read_box(hf: HFFolder, name: str, index: list[Tensor]) -> tuple[Tensor, int]:
    """(the elements of HF tensor `name` at the cross product of `index`, one vector of indices per dim; bytes read).

    One slice read of their bounding box (an FP8 weight's dequantized with its blocks' scales), then a gather along
    the dims whose indices are not one ascending run: for the common row or column shard (FSDP, TP) the box is the
    shard itself and nothing is gathered; q/k rows reordered within heads gather along rows. Index vectors are per
    dim, never as large as the shard.
    """
    starts = [int(v.min()) for v in index]
    box = _read_slice(hf.files[name], name, tuple(slice(s, int(v.max()) + 1) for s, v in zip(starts, index)))
    read = box.numel() * box.element_size()
    if (scale := hf.scales.get(name)) is not None:
        try:
            box = dequantize(box, starts, scale, lambda slices: _read_slice(hf.files[scale.name], scale.name, slices))
        except ValueError as e:
            raise ConfigError(f"{hf.files[scale.name]}: {e}; the file is damaged, download it again") from None
    for dim, (start, v) in enumerate(zip(starts, index)):
        if not torch.equal(v, torch.arange(start, start + len(v))):
            box = box.index_select(dim, v - start)
    return box, read


def read_part(hf: HFFolder, name: str, index: list[Tensor]) -> tuple[Tensor, int]:
    """(the elements of titan parameter `name` at the cross product of `index`, one vector of global indices per
    dim, as the HF files hold them; bytes read). A tied copy in the files is read alike and must be equal. Of a
    stack, only the HF tensors index[0] picks are read."""
    hf_name, rows = hf.sources[name]
    if isinstance(hf_name, str):
        return _read_one(hf, hf_name, rows, index)
    parts = [_read_one(hf, hf_name[i], rows, index[1:]) for i in index[0].tolist()]
    return torch.stack([values for values, _ in parts]), sum(n for _, n in parts)


def _read_one(hf: HFFolder, hf_name: str, rows: Tensor | None, index: list[Tensor]) -> tuple[Tensor, int]:
    """read_part of one HF tensor: index in titan's numbering, of which rows gives HF's (None: the same)."""
    if rows is not None:  # the titan rows wanted, as HF numbers them
        index = [rows[index[0]], *index[1:]]
    values, read = _read_box(hf, hf_name, index)
    for copy in [c for c, original in hf.copies.items() if original == hf_name]:
        copied, n = _read_box(hf, copy, index)
        read += n
        if not torch.equal(copied, values):
            raise ConfigError(f"{hf.path}: {copy} differs from {hf_name}, of which the model makes it a copy")
    return values, read


@torch.no_grad()
def read_into(hf: HFFolder, named_tensors, what: str) -> tuple[int, int]:
    """Fill each (titan name, tensor) with its part of the HF weights, cast to the tensor's dtype: a whole plain
    tensor, or the local shard of a DTensor of any layout, showing progress as `what`. Returns (tensors written,
    bytes read from the files)."""
    named_tensors = list(named_tensors)
    total = sum(param.numel() * param.element_size() for _, param in named_tensors)  # of the whole model
    count = read = 0
    with Progress(what, total, "B") as progress:
        for name, param in named_tensors:
            local, index = _shard_index(name, param)
            if local.numel():
                values, n = read_part(hf, name, index)
                local.copy_(values)
                read += n
            count += 1
            progress.update(param.numel() * param.element_size())
    return count, read


# ---------------------------------------------------------------------------------------------------------------
# Writing a folder atomically
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_folder(out: Path):
    """Yield a temporary folder beside `out`, renamed to `out` when the block succeeds (as checkpoints are)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output folder {out} already exists and is not empty; remove it or choose another")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _umask_modes(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename does not replace a folder everywhere
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask_modes(folder: Path) -> None:
    """Give the files in `folder` the mode the user's umask gives a new file: some writers use their own
    (safetensors writes 0600), and an export is meant to be shared as the user's other files are."""
    umask = os.umask(0)  # reading the umask sets it: put back at once
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)
