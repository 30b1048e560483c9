"""Weights in transit to an inference server in the forms SGLang 0.5.17's `/update_weights_from_tensor`
takes: named tensors pickled with torch's multiprocessing reductions (SGLang's `MultiprocessingSerializer`,
base64 for HTTP), as a list of `(name, tensor)` or as one flattened bucket (`load_format="flattened_bucket"`),
and bounded buckets of a model's tensors. The trainer's push and the reference engine's receiving side
share this module, so the two cannot drift apart.

What travels is a handle, not the bytes: a CUDA tensor as a CUDA IPC handle (SGLang's one-GPU path), a CPU
tensor as the name of a shared-memory file (torch's "file_system" sharing strategy; the default
"file_descriptor" strategy hands file descriptors over a socket that only the sender's own child processes
may open). The sender keeps its tensors alive until the server has answered.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import pickle
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.multiprocessing as torch_mp

NamedTensors = list[tuple[str, torch.Tensor]]
LoadFormat = Literal["flattened_bucket"] | None
FLATTENED_BUCKET = "flattened_bucket"

# What a payload may name when it is unpickled: tensors, their storages and dtypes, and the bucket's
# metadata records. Anything else (a pickle can name any callable) is refused.
_ALLOWED = {
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("types", "SimpleNamespace"),
    ("collections", "OrderedDict"),
}


class PayloadError(ValueError):
    """A serialized payload that is not one of the forms above."""


def serialize(named: Sequence[tuple[str, torch.Tensor]], load_format: LoadFormat = None) -> str:
    """One entry of `serialized_named_tensors` (base64 text), holding `named` as a list or as one flattened
    bucket. A CPU tensor is moved into shared memory by this (torch does that to share it)."""
    obj: Any = list(named) if load_format is None else flatten(named)
    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def deserialize(payload: bytes | str, load_format: LoadFormat = None) -> NamedTensors:
    """The named tensors of one `serialized_named_tensors` entry (raw pickle bytes or base64).
    PayloadError for anything else."""
    data = payload.encode("ascii") if isinstance(payload, str) else bytes(payload)
    if not data.startswith(b"\x80"):  # not a pickle: base64 of one
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PayloadError("serialized_named_tensors entries must be base64 pickles") from exc
    try:
        obj = _RestrictedUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError, TypeError) as exc:
        raise PayloadError(f"could not read the serialized tensors: {exc}") from exc
    named = obj if load_format is None else unflatten(obj)
    if not isinstance(named, list) or not all(_is_named_tensor(item) for item in named):
        raise PayloadError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named]


def flatten(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """SGLang's flattened bucket: the tensors' bytes in one uint8 tensor and a record per tensor (name,
    shape, dtype, byte range). The records are SimpleNamespaces, which SGLang's unpickler accepts without
    this side importing SGLang's own record class."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    parts, metadata, start = [], [], 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().flatten().view(torch.uint8)
        parts.append(flat)
        end = start + flat.numel()
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=start,
                end_idx=end,
                numel=end - start,
            )
        )
        start = end
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def describe(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
    """What `/update_weights_from_distributed` announces of a broadcast's tensors: `names`, `dtypes` (torch's
    names: "bfloat16") and `shapes`."""
    return {
        "names": [name for name, _ in named],
        "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in named],
        "shapes": [list(tensor.shape) for _, tensor in named],
    }


def unflatten(bucket: Any) -> NamedTensors:
    """The named tensors of a flattened bucket (views into its one tensor)."""
    try:
        flat, metadata = bucket["flattened_tensor"], bucket["metadata"]
        return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]
    except (KeyError, TypeError, AttributeError, RuntimeError) as exc:
        raise PayloadError(f"not a flattened bucket: {exc}") from exc


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[NamedTensors]:
    """`named` in consecutive groups of at most `max_bytes` each (a larger tensor alone), so the server
    holds at most one bucket beside its weights while it loads."""
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _is_named_tensor(item: Any) -> bool:
    return (
        isinstance(item, tuple | list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    )


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(before)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name} from a weights payload")
