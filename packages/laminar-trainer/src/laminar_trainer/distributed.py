"""Multi-process trainers: torch.distributed with FSDP2 (``fully_shard``).

A trainer runs on N ranks when started by ``torchrun`` (``WORLD_SIZE`` > 1)::

    torchrun --nproc-per-node 8 -m laminar_trainer.cli run --config trainer.yaml

Rank 0 is the trainer the rest of the stack sees: it owns the experience
buffer, the trajectory socket, etcd membership, acks, publishing, checkpoints
and metrics. Ranks > 0 are followers: they hold a shard of the model and
optimizer and execute the collective part of whatever rank 0 does, in the same
order. Rank 0 drives them with commands broadcast over the process group (a
small header tensor, then a msgpack payload for a step's groups; nothing is
pickled):

- ``STEP``: every rank decodes the step's groups and trains on its share of
  each mini-batch (``mini_batch[rank::world]``, see ``laminar_trainer.step``);
  FSDP averages gradients during backward.
- ``GATHER``: the full state dict is gathered to rank 0, one tensor at a time
  (to publish weights, cast to the published dtype as they arrive).
- ``CHECKPOINT``: full model and optimizer state are gathered to rank 0, which
  writes them (``laminar_trainer.checkpoint``); with ``arg`` 1 (a sharded
  checkpoint) every rank writes its own shards to the directory in the payload
  instead (``torch.distributed.checkpoint``), and nothing is gathered.
- ``EVAL``: every rank decodes the same held-out prompts greedily (the forward
  of a sharded model is a collective); rank 0 reports the accuracy.
- ``STOP``: followers leave their loop.

Precision: with ``dtype: bfloat16`` every ``fully_shard`` gets
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: the
sharded parameters and the optimizer state stay float32 (the master weights),
the all-gathered parameters of a forward/backward are bfloat16, gradients are
reduced in float32. Gathers for publishing and checkpoints read the float32
shards.

Devices: ``cuda:<LOCAL_RANK>`` with NCCL when CUDA is there and
``device`` allows it, else CPU with gloo (this is how it is tested here). The
commands always travel over gloo, on CPU tensors.

Invariants: every rank sees the same command sequence; each mini-batch splits
into equal shards (``batch_groups / mini_batches`` a multiple of the world
size, checked at start); a
single-process trainer (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) never touches
torch.distributed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from laminar_common.codec import Trajectory
from laminar_common.errors import LaminarError

from .buffer import Group

__all__ = ["Command", "DistContext", "decode_groups", "encode_groups",
           "enable_activation_checkpointing", "init_distributed", "load_local_shards",
           "load_sharded", "params_on_meta", "resolve_device", "save_sharded"]

log = logging.getLogger(__name__)


class Command:
    """Command codes rank 0 broadcasts to its followers."""

    STEP = 1
    GATHER = 2
    CHECKPOINT = 3
    EVAL = 4
    STOP = 5
    NAMES = {1: "STEP", 2: "GATHER", 3: "CHECKPOINT", 4: "EVAL", 5: "STOP"}


_GroupsWire = list[tuple[str, int, float, list[Trajectory]]]


def encode_groups(groups: list[Group]) -> bytes:
    """A step's groups as msgpack: ``[(prompt_id, group_size, weight, [trajectory...])]``."""
    return msgspec.msgpack.encode(
        [(g.prompt_id, g.group_size, g.weight, g.trajectories()) for g in groups])


def decode_groups(payload: bytes) -> list[Group]:
    """Inverse of :func:`encode_groups`; a bad payload raises ``LaminarError``.

    Rank 0 only ever sends complete groups, so a group its trajectories do not
    fill exactly (missing, extra or repeated samples, another prompt's
    trajectory) is refused rather than trained on in part.
    """
    try:
        rows = msgspec.msgpack.decode(payload, type=_GroupsWire)
    except msgspec.DecodeError as exc:
        raise LaminarError(f"STEP payload from rank 0 does not decode: {exc}") from exc
    groups = []
    for prompt_id, size, weight, trajs in rows:
        members = {t.sample_index: t for t in trajs}
        if len(members) != size or len(trajs) != size or any(
                t.prompt_id != prompt_id for t in trajs):
            raise LaminarError(
                f"STEP payload from rank 0: group {prompt_id!r} of size {size} carries "
                f"{len(trajs)} trajectories of {len(members)} distinct samples "
                f"(prompts {sorted({t.prompt_id for t in trajs})[:3]}); it is not a complete group")
        groups.append(Group(prompt_id, size, members, weight))
    return groups


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """``auto``: ``cuda:<local_rank>`` if CUDA is available, else CPU; or an explicit device."""
    if setting == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() \
            else torch.device("cpu")
    if setting == "cuda":
        if not torch.cuda.is_available():
            raise LaminarError("trainer config: device is 'cuda' but CUDA is not available")
        return torch.device(f"cuda:{local_rank}")
    if setting == "cpu":
        return torch.device("cpu")
    raise LaminarError(f"trainer config: device must be auto, cpu or cuda, got {setting!r}")


@dataclass
class DistContext:
    """This process's place in a multi-rank trainer (see module docstring)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu_group: Any = None
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- commands -----------------------------------------------------------------

    def send_command(self, command: int, payload: bytes = b"", arg: int = 0) -> None:
        """Rank 0: broadcast a command (and its payload) to every follower."""
        import torch.distributed as dist

        header = torch.tensor([command, len(payload), arg], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        if payload:
            self._broadcast_payload(payload, len(payload))

    def recv_command(self) -> tuple[int, bytes, int]:
        """Followers: wait for rank 0's next command; returns (command, payload, arg)."""
        import torch.distributed as dist

        header = torch.zeros(3, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        command, size, arg = (int(x) for x in header)
        if command not in Command.NAMES:
            raise LaminarError(f"rank {self.rank}: unknown command {command} from rank 0")
        payload = self._broadcast_payload(b"", size) if size else b""
        return command, payload, arg

    def _broadcast_payload(self, data: bytes, size: int) -> bytes:
        """Rank 0's ``data`` (``size`` bytes, known to every rank) on every rank."""
        import torch.distributed as dist

        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.is_main
               else torch.empty(size, dtype=torch.uint8))
        dist.broadcast(buf, src=0, group=self.cpu_group)
        return buf.numpy().tobytes()

    # -- rank 0's side of each command (the followers' side is run_follower) --------

    def send_step(self, groups: list[Group], version: int = 0) -> list[Group]:
        """Rank 0: send a step's groups (and the weights' version at the step's start) to
        every rank; returns them (every rank trains on the whole list: ``train_step``
        takes each rank's share of every mini-batch)."""
        self.send_command(Command.STEP, encode_groups(groups), version)
        return groups

    def gather_for_publish(self, model: torch.nn.Module, dtype: torch.dtype | None = None
                           ) -> dict[str, torch.Tensor]:
        """Rank 0: the full weights (CPU) for a publish (floating tensors in ``dtype``) or
        the final save (``dtype`` None: float32); the followers join the gather."""
        self.send_command(Command.GATHER)
        return self.gather_tensors(model, dtype)

    def gather_tensors(self, model: torch.nn.Module, dtype: torch.dtype | None = None
                       ) -> dict[str, torch.Tensor]:
        """Collective: the full state dict on rank 0 (CPU tensors, floating ones cast to
        ``dtype`` on the device first), ``{}`` elsewhere. One tensor at a time is
        gathered, cast and copied to the host, so rank 0's host memory peaks at the
        published bytes (half the float32 state in bf16) plus one tensor, and each
        device at one unsharded tensor."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
            if not self.is_main:
                continue
            fresh = isinstance(tensor, DTensor)  # full_tensor() made a new tensor
            if dtype is not None and full.is_floating_point() and full.dtype != dtype:
                full, fresh = full.to(dtype), True
            # Never the model's own storage: the next step must not change what is sent.
            out[name] = full.to("cpu", copy=not fresh)
        return out

    def save_sharded(self, model: torch.nn.Module, optimizer, path: Path) -> None:
        """Rank 0: have every rank write its shards of model and optimizer to ``path``
        (``torch.distributed.checkpoint``; a shared filesystem)."""
        self.send_command(Command.CHECKPOINT, os.fsencode(path), 1)
        save_sharded(model, optimizer, path)

    def gather_for_checkpoint(self, model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
        """Rank 0: full model and optimizer state (CPU) for a checkpoint."""
        self.send_command(Command.CHECKPOINT)
        return self.full_model_state(model), self.full_optimizer_state(model, optimizer)

    def send_eval(self, records: list[dict], max_new_tokens: int) -> None:
        """Rank 0: have every rank decode the held-out records with it."""
        self.send_command(Command.EVAL, msgspec.msgpack.encode(records), max_new_tokens)

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass anything)."""
        size = self.broadcast_int(len(data))
        return self._broadcast_payload(data, size) if size else b""

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.cpu_group)
        return int(t.item())

    # -- model --------------------------------------------------------------------

    def shard(self, model: torch.nn.Module, dtype: str = "float32") -> torch.nn.Module:
        """FSDP2: each decoder layer, then the root (the usual wrapping for causal LMs),
        with the mixed-precision policy of a training ``dtype`` (see module docstring)."""
        from torch.distributed.fsdp import fully_shard

        from .precision import mixed_precision_policy

        policy = mixed_precision_policy(dtype)
        kwargs = {"mp_policy": policy} if policy is not None else {}
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers or ():
            fully_shard(layer, mesh=self.mesh, **kwargs)
        fully_shard(model, mesh=self.mesh, **kwargs)
        return model

    def build_sharded(self, model_dir: str | os.PathLike[str], dtype: str = "float32",
                      activation_checkpointing: bool = False) -> torch.nn.Module:
        """The model of ``model_dir`` sharded over the ranks, built without a full copy
        anywhere: its parameters are created on the meta device, sharded with
        :meth:`shard`, allocated on this rank's device (``to_empty``; buffers such as
        rotary frequencies are computed on the CPU at build and copied back), then each
        rank reads only its own rows of each tensor from the safetensors files
        (memory-mapped; see :func:`load_local_shards`). Parameters are float32 (the
        master weights)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        with params_on_meta():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        self.shard(model, dtype)
        model.to_empty(device=self.device)
        with torch.no_grad():
            for name, value in buffers.items():
                model.get_buffer(name).copy_(value)
        load_local_shards(model, model_dir, self.rank, self.world_size)
        model.train()
        return model

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` summed (``"sum"``) or maxed (``"max"``) over the ranks, element-wise
        (the same length on every rank), in float64."""
        import torch.distributed as dist

        if not values:
            return []
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=reduce_op, group=self.cpu_group)
        return [float(v) for v in tensor]

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the unsharded state dict on rank 0 (CPU tensors), ``{}`` elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_optimizer_state(self, model, optimizer) -> dict:
        """Collective: the unsharded optimizer state on rank 0 (keyed by parameter name)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, model, optimizer, model_state: dict, optim_state: dict) -> None:
        """Collective: rank 0's full model/optimizer state, sharded onto every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, model_state, options=options)
        set_optimizer_state_dict(model, optimizer, optim_state, options=options)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def save_sharded(model: torch.nn.Module, optimizer, path: str | os.PathLike[str]) -> None:
    """Collective (or one process): model and optimizer state by parameter name, each
    rank writing its own shards (``torch.distributed.checkpoint.save``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    try:
        with _one_process_is_meant():
            dcp.save({"model": model_state, "optim": optim_state},
                     checkpoint_id=os.fspath(path))
    except CheckpointException as exc:  # a BaseException: it would pass every handler
        raise LaminarError(f"sharded checkpoint {path} could not be written: "
                           f"{str(exc)[:500]}") from exc


@contextlib.contextmanager
def _one_process_is_meant():
    # Without a process group the checkpoint reader/writer warns that it assumes one
    # process: that is what a one-process trainer means.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_sharded(model: torch.nn.Module, optimizer, path: str | os.PathLike[str]) -> None:
    """Collective (or one process): load a sharded checkpoint's model (and optimizer,
    unless None) into this rank's shards, whatever the number of ranks that wrote it.

    Raises:
        LaminarError: the checkpoint cannot be read or does not fit the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    try:
        if optimizer is None:
            model_state = get_model_state_dict(model)
            with _one_process_is_meant():
                dcp.load({"model": model_state}, checkpoint_id=os.fspath(path))
            set_model_state_dict(model, model_state)
            return
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=os.fspath(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    except (RuntimeError, ValueError, KeyError, OSError, CheckpointException) as exc:
        # CheckpointException (missing keys, other shapes, unreadable files) is a
        # BaseException: caught by name, or it would pass every handler.
        raise LaminarError(f"sharded checkpoint {path} cannot be loaded into this model: "
                           f"{type(exc).__name__}: {str(exc)[:500]}") from exc


@contextlib.contextmanager
def params_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no
    initialisation) and their buffers where they are computed (the CPU): parameters are
    moved as they are registered, before any init touches them."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them
    (Hugging Face's gradient checkpointing, non-reentrant: it composes with FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer transformers 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        import json

        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as exc:
            raise LaminarError(f"{index}: not a safetensors index ({exc})") from exc
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise LaminarError(f"{model_dir}: no model.safetensors (nor an index of shards)")
    return [single]


def load_local_shards(model: torch.nn.Module, model_dir: str | os.PathLike[str], rank: int,
                      world_size: int) -> int:
    """Copy this rank's rows of every parameter from ``model_dir``'s safetensors files
    into the model FSDP2 sharded (dim 0 cut as ``torch.chunk`` cuts it); returns the
    bytes read. Only the slices this rank holds are read from the memory-mapped files.
    Tied parameters (an untied-looking ``lm_head`` the file omits) load once.

    Raises:
        LaminarError: a parameter is missing from the files or has another shape.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    model_dir = Path(model_dir)
    handles = {}
    for file in _safetensors_files(model_dir):
        f = safe_open(str(file), framework="pt")
        for key in f.keys():  # noqa: SIM118 - safe_open has keys(), not iteration
            handles[key] = f
    params = dict(model.named_parameters())
    missing = sorted(name for name in params if name not in handles)
    if missing:
        raise LaminarError(f"{model_dir}: the checkpoint lacks parameters {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")
    read = 0
    with torch.no_grad():
        for name, param in params.items():
            sliced = handles[name].get_slice(name)
            shape = tuple(sliced.get_shape())
            if shape != tuple(param.shape):
                raise LaminarError(f"{model_dir}: parameter {name!r} has shape {shape}, "
                                   f"the model expects {tuple(param.shape)}")
            local = param.to_local() if isinstance(param, DTensor) else param.data
            if isinstance(param, DTensor) and shape:
                rows = -(-shape[0] // world_size)
                start, stop = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
                if local.shape[0] != stop - start:
                    raise LaminarError(f"parameter {name!r}: rank {rank} holds "
                                       f"{local.shape[0]} rows, expected {stop - start}")
                part = sliced[start:stop] if stop > start else None
            else:
                part = sliced[:] if shape else handles[name].get_tensor(name)
            if part is not None:
                local.copy_(part)
                read += part.numel() * part.element_size()
    return read


def init_distributed(device_setting: str, batch_groups: int,
                     timeout_s: float = 1800.0, mini_batches: int = 1) -> DistContext | None:
    """Join the process group if started by torchrun with ``WORLD_SIZE`` > 1; else None.

    ``timeout_s`` bounds every collective, including followers waiting for
    rank 0's next command while it waits for data.

    Raises:
        LaminarError: a mini-batch (``batch_groups / mini_batches`` groups) does not
            split evenly over the ranks, or the device setting cannot be honoured.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if batch_groups % world:
        raise LaminarError(f"trainer config: batch_groups ({batch_groups}) must be a multiple "
                           f"of the number of trainer ranks ({world})")
    if (batch_groups // mini_batches) % world:
        raise LaminarError(f"trainer config: a mini-batch (batch_groups {batch_groups} / "
                           f"optim.mini_batches {mini_batches}) must be a multiple of the "
                           f"number of trainer ranks ({world})")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = resolve_device(device_setting, local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    mesh = init_device_mesh(device.type, (world,))
    log.info("trainer rank %d of %d on %s", rank, world, device)
    return DistContext(rank, world, local_rank, device, cpu_group, mesh)
