"""``TorchEngine``: continuous batching over a Hugging Face causal LM in plain PyTorch.

The reference engine: exact, CPU-capable, and small enough to read. It is what
tests and CPU-only deployments use; vLLM is the production engine.

How a step runs:

1. **Decode.** Every active sequence feeds its last sampled token in *one*
   batched forward. The KV cache lives in a per-layer slot store
   ``[max_batch, kv_heads, capacity, head_dim]``; slot ``s`` holds its
   sequence's keys/values at positions ``0 .. len_s - 1``, and the active
   sequences always hold slots ``0 .. n - 1`` (a finished sequence's slot is
   refilled by the last active one: one slot's cache copied, never the batch's).
   The forward runs on a :class:`SlotCache` over views of the store, nothing
   gathered: each layer writes the new token's key/value *in place* at
   ``(s, len_s)`` and attends over ``store[:n, :, :L + 1]`` (``L`` = the longest
   length); a 2-D attention mask keeps each row to its own ``0 .. len_s`` and
   ``position_ids = len_s`` keeps RoPE positions exact.
2. **Admit and prefill.** Freed slots take queued requests; all of them are
   prefilled in one right-padded forward (``prompt + resume`` tokens) and
   sample their first token from the last real position. A migrated request
   that brings its cache (``request.kv``, from ``export_with_kv`` of another
   ``TorchEngine`` with the same model shape, or a conversation's previous turn
   with ``keep_kv``) skips the prefill: its cache is copied into the slot, the
   tokens it does not cover (a turn's tool results) are run through one forward
   over it, and it decodes from its last resumed token.

Precision: the model and its KV cache are in the model's dtype (``dtype``
when loading from a directory, e.g. bfloat16); logits are cast to float32
before sampling, so log-probs are float32; weights arriving in another
floating dtype are cast on load.

Finished sequences free their slot within the step, so the next queued
request starts in the same step. The engine never lets weights change under an
unfinished request.

Rows admitted together with identical inputs (a GRPO group's samples of one prompt)
are prefilled once and their caches copied (``shared_prefill_tokens``).

Limits: full-attention decoder models only (sliding-window layers are refused
when the window is shorter than the context), no prefix sharing beyond identical
inputs admitted in one step, and memory is
``max_batch x longest sequence`` per layer. Written against transformers 5.x
(``cache=`` keyword; ``past_key_values=`` is used when a model still takes it).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from ._sampling import sample_next_tokens
from ._sequences import SequenceState, SequenceTable
from .base import (
    EngineError,
    EngineLoad,
    GenerationEngine,
    GenerationOutput,
    GenerationRequest,
    KVState,
    PartialProgress,
    check_fits_context,
    check_load_weights_allowed,
    check_weight_version,
)

logger = logging.getLogger(__name__)

_MIN_CAPACITY = 64


def _eos_ids_of(model: PreTrainedModel) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        ids.extend([value] if isinstance(value, int) else list(value))
    return tuple(dict.fromkeys(ids))


def _layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        entry = cache.layers[layer]
        return entry.keys, entry.values
    return cache.key_cache[layer], cache.value_cache[layer]


def _kv_geometry(config: Any, dtype: torch.dtype) -> tuple[int, int, int, torch.dtype]:
    """(layers, KV heads, head size, dtype) of the model's attention cache."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim, dtype


def _num_layers(cache: Any) -> int:
    return len(cache.layers) if hasattr(cache, "layers") else len(cache.key_cache)


class _SlotLayer(CacheLayerMixin):
    """One layer of :class:`SlotCache`: writes a decode step's keys/values into the slot
    store in place and hands attention a view of the active rows (no copy)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor,
                 lens: torch.Tensor, width: int) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self._rows, self._lens, self._width = rows, lens, width
        self._n = int(rows.numel())
        self.is_initialized = True
        self.device = keys.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the store exists already

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != self._n or key_states.shape[2] != 1:
            raise EngineError(f"slot cache takes one new token for each of {self._n} rows, got "
                              f"keys shaped {tuple(key_states.shape)}")
        self.keys[self._rows, :, self._lens] = key_states[:, :, 0]
        self.values[self._rows, :, self._lens] = value_states[:, :, 0]
        end = self._width + 1
        return self.keys[: self._n, :, :end], self.values[: self._n, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._width + query_length, 0

    def get_seq_length(self) -> int:
        return self._width

    def get_max_length(self) -> int:
        return -1


class SlotCache(Cache):
    """The decode step's cache: per layer, the engine's slot store for rows
    ``0 .. n - 1`` whose new tokens go to positions ``lens`` (see the module docstring).
    The model sees ``width = max(lens)`` past tokens per row; the attention mask hides
    each row's columns past its own ``lens``."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                 lens: torch.Tensor) -> None:
        rows = torch.arange(lens.numel(), device=lens.device)
        width = int(lens.max())
        super().__init__(layers=[_SlotLayer(k, v, rows, lens, width)
                                 for k, v in zip(keys, values)])


class TorchEngine(GenerationEngine):
    """Continuous-batching generation engine on a transformers causal LM.

    ``prefilled_tokens`` counts the tokens run through prefill forwards;
    ``kv_reused_tokens`` the tokens a request's cache brought instead (what KV
    transfer saves a migrated trajectory, and a conversation's next turn).

    Args:
        model: A loaded ``PreTrainedModel`` (causal LM), or a local directory
            to load one from with ``from_pretrained`` (no hub access).
        max_batch: Decode slots, i.e. the most sequences generated at once.
        context_length: Prompt plus response limit; defaults to (and may not
            exceed) the model's ``max_position_embeddings``.
        weight_version: Version of the weights the model holds now.
        eos_token_ids: Tokens that end every response; ``None`` takes them
            from the model's generation config, ``()`` disables EOS.
        seed: Seed of the generator used by requests without their own seed.
        device: Move the model here; ``None`` keeps it where it is.
        dtype: Dtype when loading from a directory (ignored for a model object);
            ``None`` takes config.json's. Weights loaded later are cast into the
            model's dtype; sampling and log-probs are float32 whatever it is.

    Raises:
        EngineError: the model cannot be loaded or is not supported.
        ValueError: a bad argument.
    """

    def __init__(
        self,
        model: PreTrainedModel | str | os.PathLike[str],
        *,
        max_batch: int = 8,
        context_length: int | None = None,
        weight_version: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            model = self._load(model, dtype)
        if not isinstance(model, torch.nn.Module):
            raise EngineError(f"model must be a transformers causal LM, got {type(model).__name__}")
        if device is not None:
            model = model.to(device)
        model.eval()
        self._model = model
        self._device = next(model.parameters()).device
        self._table = SequenceTable(max_batch)
        self._version = check_weight_version(weight_version)
        self._weights_intact = True

        config = (
            model.config.get_text_config()
            if hasattr(model.config, "get_text_config")
            else model.config
        )
        max_pos = getattr(config, "max_position_embeddings", None)
        if context_length is None:
            if max_pos is None:
                raise ValueError(
                    "context_length is required: the model config has no max_position_embeddings"
                )
            context_length = int(max_pos)
        if (
            isinstance(context_length, bool)
            or not isinstance(context_length, int)
            or context_length < 2
        ):
            raise ValueError(f"context_length must be an int >= 2, got {context_length!r}")
        if max_pos is not None and context_length > max_pos:
            raise ValueError(
                f"context_length {context_length} exceeds the model's "
                f"max_position_embeddings {max_pos}"
            )
        self._context_length = context_length
        self._check_attention(config)

        params = inspect.signature(model.forward).parameters
        if "cache" in params:
            self._cache_kw = "cache"
        elif "past_key_values" in params:
            self._cache_kw = "past_key_values"
        else:
            raise EngineError(f"{type(model).__name__}.forward takes no KV cache argument")
        self._keep_logits = "logits_to_keep" in params
        self._vocab = model.get_input_embeddings().num_embeddings
        self._eos = tuple(eos_token_ids) if eos_token_ids is not None else _eos_ids_of(model)
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)

        # slot KV store, allocated at the first prefill when head shapes are known
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._capacity = 0
        self._lens = [0] * max_batch
        self._pending = [0] * max_batch
        self._kv_shape = _kv_geometry(config, next(model.parameters()).dtype)
        self.prefilled_tokens = 0
        self.kv_reused_tokens = 0
        self.shared_prefill_tokens = 0
        """Prompt tokens not computed because another row admitted with it had the same
        input (a GRPO group's samples): its cache was copied instead."""
        self.compactions = 0
        """Sequences moved to a lower slot (one slot's cache copied each)."""

    @staticmethod
    def _load(path: str | os.PathLike[str], dtype: torch.dtype | None) -> PreTrainedModel:
        try:
            return AutoModelForCausalLM.from_pretrained(
                os.fspath(path), local_files_only=True, dtype=dtype
            )
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load a causal LM from {os.fspath(path)!r}: {exc}") from exc

    def _check_attention(self, config: Any) -> None:
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        uses_window = bool(window) and getattr(config, "use_sliding_window", True) is not False
        if layer_types is not None:
            uses_window = uses_window and any(t != "full_attention" for t in layer_types)
            other = sorted(
                {t for t in layer_types if t not in ("full_attention", "sliding_attention")}
            )
            if other:
                raise EngineError(f"TorchEngine supports attention layers only, model has {other}")
        if uses_window and window < self._context_length:
            raise EngineError(
                f"sliding-window attention (window {window}) shorter than context_length "
                f"{self._context_length} is not supported by TorchEngine"
            )

    # -- interface -------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def context_length(self) -> int:
        return self._context_length

    @property
    def model(self) -> PreTrainedModel:
        """The wrapped model (do not change its weights while requests are unfinished)."""
        return self._model

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def add_request(self, request: GenerationRequest) -> None:
        if not self._weights_intact:
            raise EngineError(
                f"refusing request {request.request_id!r}: the last load_weights failed midway, "
                "so the weights are inconsistent until a load_weights succeeds"
            )
        check_fits_context(request, self._context_length)
        bad = [
            t for t in (*request.prompt_token_ids, *request.resume_token_ids) if t >= self._vocab
        ]
        if bad:
            raise EngineError(
                f"request {request.request_id!r}: token id {bad[0]} is outside the model's "
                f"vocabulary of {self._vocab}"
            )
        if request.kv is not None:
            self._check_kv(request)
        self._table.add(request, weight_version=self._version, eos_ids=self._eos)

    supports_kv_transfer = True

    def kv_layout(self) -> tuple[str, int, int, int, str]:
        layers, heads, head_dim, dtype = self._kv_shape
        return "torch", layers, heads, head_dim, str(dtype).removeprefix("torch.")

    def _check_kv(self, request: GenerationRequest) -> None:
        """A cache fits when it has this model's layers, KV heads, head size and dtype."""
        kv = request.kv
        where = f"request {request.request_id!r}: kv"
        if kv.engine != "torch":
            raise EngineError(f"{where} was written by a {kv.engine!r} engine, not 'torch'")
        layers, heads, head_dim, dtype = self._kv_shape
        if len(kv.keys) != layers or len(kv.values) != layers:
            raise EngineError(f"{where} has {len(kv.keys)}/{len(kv.values)} layers of keys/values,"
                              f" the model has {layers}")
        for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
            for name, t in (("keys", k), ("values", v)):
                if tuple(t.shape) != (heads, kv.num_tokens, head_dim) or t.dtype != dtype:
                    raise EngineError(
                        f"{where} {name}[{layer}] is {tuple(t.shape)} {t.dtype}; this engine "
                        f"caches [{heads}, {kv.num_tokens}, {head_dim}] {dtype}")

    def export_with_kv(self, request_ids: Iterable[str] | None = None,
                       max_bytes: int | None = None) -> list[GenerationRequest]:
        """``export`` with the cache of every decoding request attached (host copies, one
        sequence at a time; a cache over ``max_bytes`` is not copied at all)."""
        if request_ids is not None and not isinstance(request_ids, str):
            request_ids = list(request_ids)
        slots = {s.request_id: s.slot for s in self._table.active()}
        lens = list(self._lens)
        seqs = self._table.take(request_ids)
        layers, heads, head_dim, dtype = self._kv_shape
        per_token = 2 * layers * heads * head_dim * dtype.itemsize
        out = []
        for seq in seqs:
            slot = slots.get(seq.request_id)
            kv = None
            n = lens[slot] if slot is not None else 0
            if slot is not None and seq.token_ids and \
                    (max_bytes is None or n * per_token <= max_bytes):
                kv = self._slot_cache(slot, n, "cpu")
            out.append(SequenceTable.resumable(seq, self._version, kv))
        return out

    def _slot_cache(self, slot: int, n: int, device: Any) -> KVState:
        """A copy (on ``device``) of the first ``n`` positions of ``slot``'s cache."""
        return KVState("torch", n,
                       tuple(k[slot, :, :n].to(device, copy=True) for k in self._keys),
                       tuple(v[slot, :, :n].to(device, copy=True) for v in self._values))

    def has_unfinished(self) -> bool:
        return len(self._table) > 0

    def load(self) -> EngineLoad:
        active = self._table.active()
        return EngineLoad(
            active=len(active),
            queued=len(self._table.queued()),
            max_batch=self._table.max_batch,
            kv_used_tokens=sum(self._lens[s.slot] for s in active),
            kv_capacity_tokens=self._table.max_batch * self._context_length,
        )

    def progress(self) -> list[PartialProgress]:
        return self._table.progress(self._version)

    def export(self, request_ids: Iterable[str] | None = None) -> list[GenerationRequest]:
        return [SequenceTable.resumable(s, self._version) for s in self._table.take(request_ids)]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationOutput]:
        return [
            SequenceTable.output(s, "aborted", self._version, simulated=False)
            for s in self._table.take(request_ids)
        ]

    def load_weights(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | None,
    ) -> None:
        """Copy named tensors into the model's parameters, then adopt ``version``.

        ``named_tensors`` may cover a subset of the parameters (tied names such
        as ``lm_head.weight`` are accepted). Floating-point tensors in another
        floating dtype than the model's (a trainer publishing bfloat16 to a
        float32 engine, or the reverse) are cast as they are copied. Tensors are
        checked and copied as they stream in; if one is rejected the weights are
        left partially updated, so the engine refuses requests until a later
        load succeeds.

        Raises:
            EngineError: busy engine, version not newer, no tensors, or a name,
                shape or dtype kind (floating vs not) that does not match the model.
        """
        check_load_weights_allowed(self, version)
        if named_tensors is None:
            raise EngineError("TorchEngine.load_weights needs named tensors, got None")
        params = dict(self._model.named_parameters(remove_duplicate=False))
        loaded = 0
        self._weights_intact = False
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None:
                    raise EngineError(
                        f"weights v{version}: tensor {name!r} is not a parameter of the model"
                    )
                if not isinstance(tensor, torch.Tensor):
                    raise EngineError(
                        f"weights v{version}: {name!r} is a {type(tensor).__name__}, not a tensor"
                    )
                if tensor.shape != target.shape:
                    raise EngineError(
                        f"weights v{version}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                if tensor.dtype != target.dtype and not (
                    tensor.is_floating_point() and target.is_floating_point()
                ):
                    raise EngineError(
                        f"weights v{version}: tensor {name!r} has dtype {tensor.dtype}, "
                        f"the model expects {target.dtype}"
                    )
                target.copy_(tensor)  # casts to the model's dtype (and device)
                loaded += 1
        if loaded == 0:
            raise EngineError(f"weights v{version}: no tensors were given")
        self._weights_intact = True
        self._version = version
        logger.info("loaded weights v%d (%d tensors)", version, loaded)

    # -- stepping --------------------------------------------------------------------

    def step(self) -> list[GenerationOutput]:
        finished: list[GenerationOutput] = []
        with torch.inference_mode():
            running = self._table.active()
            if running:
                self._decode(running)
                finished.extend(self._collect(running))
            admitted: list[SequenceState] = []
            for slot in self._table.free_slots():
                if self._table.peek_queued() is None:
                    break
                seq = self._table.admit_next(slot)
                reason = seq.finish_reason(self._context_length)
                if reason is not None:  # a resumed trajectory that was already complete
                    self._table.release(seq)
                    finished.append(
                        SequenceTable.output(seq, reason, self._version, simulated=False)
                    )
                else:
                    admitted.append(seq)
            with_kv = [s for s in admitted if s.request.kv is not None]
            for seq in with_kv:
                self._install_kv(seq)
            to_prefill = [s for s in admitted if s not in with_kv]
            if to_prefill:
                self._prefill(to_prefill)
                finished.extend(self._collect(to_prefill))
        return finished

    def _collect(self, seqs: list[SequenceState]) -> list[GenerationOutput]:
        done = []
        for seq in seqs:
            reason = seq.finish_reason(self._context_length)
            if reason is not None:
                out = SequenceTable.output(seq, reason, self._version, simulated=False)
                if seq.request.keep_kv:
                    # every token but the last (never fed), kept on the device
                    out.kv = self._slot_cache(seq.slot, self._lens[seq.slot], self._device)
                self._table.release(seq)
                done.append(out)
        return done

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": mask,
            "position_ids": positions,
            self._cache_kw: cache,
            "use_cache": True,
        }
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        return self._model(**kwargs).logits

    def _sample(self, seqs: list[SequenceState], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_next_tokens(
            logits,
            [s.request.params for s in seqs],
            [len(s.token_ids) for s in seqs],
            self._generator,
        )
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            self._pending[seq.slot] = tok

    def _compact(self) -> list[SequenceState]:
        """Move active sequences down into free slots until they hold ``0 .. n - 1``
        (one slot's cache copied per move); returns them in slot order."""
        running = self._table.active()
        n = len(running)
        holes = [i for i in self._table.free_slots() if i < n]
        movers = [s for s in reversed(running) if s.slot >= n]
        for hole, seq in zip(holes, movers):
            old, length = seq.slot, self._lens[seq.slot]
            for k_store, v_store in zip(self._keys, self._values):
                k_store[hole, :, :length] = k_store[old, :, :length]
                v_store[hole, :, :length] = v_store[old, :, :length]
            self._table.move(seq, hole)
            self._lens[hole], self._pending[hole] = length, self._pending[old]
            self.compactions += 1
        return self._table.active()

    def _decode(self, seqs: list[SequenceState]) -> None:
        dev = self._device
        seqs = self._compact()
        lens = torch.tensor([self._lens[s.slot] for s in seqs], device=dev)
        width = int(lens.max())
        self._ensure_capacity(width + 1)
        cache = SlotCache(self._keys, self._values, lens)
        cols = torch.arange(width + 1, device=dev)
        mask = cols[None, :] <= lens[:, None]
        input_ids = torch.tensor([[self._pending[s.slot]] for s in seqs], device=dev)
        logits = self._forward(input_ids, mask.long(), lens[:, None], cache, None)[:, -1]
        for seq in seqs:
            self._lens[seq.slot] += 1
        self._sample(seqs, logits)

    def _prefill(self, seqs: list[SequenceState]) -> None:
        dev = self._device
        inputs = [s.input_ids() for s in seqs]
        # Identical inputs (a GRPO group's samples of one prompt) are run once: their
        # rows share the forward's logits and cache, and each samples on its own.
        unique: dict[tuple[int, ...], int] = {}
        row_of = [unique.setdefault(tuple(x), len(unique)) for x in inputs]
        distinct = list(unique)
        n = torch.tensor([len(x) for x in distinct], device=dev)
        width = int(n.max())
        ids = torch.zeros((len(distinct), width), dtype=torch.long, device=dev)
        for i, x in enumerate(distinct):
            ids[i, : len(x)] = torch.tensor(x, device=dev)
        cols = torch.arange(width, device=dev)
        mask = (cols[None, :] < n[:, None]).long()
        positions = cols[None, :].expand(len(distinct), width)
        last = n - 1
        rows = torch.arange(len(distinct), device=dev)
        cache = DynamicCache()
        if self._keep_logits:
            keep = torch.unique(last)
            logits = self._forward(ids, mask, positions, cache, keep)
            logits = logits[rows, torch.searchsorted(keep, last)]
        else:
            logits = self._forward(ids, mask, positions, cache, None)[rows, last]
        computed = sum(len(x) for x in distinct)
        self.prefilled_tokens += computed
        self.shared_prefill_tokens += sum(len(x) for x in inputs) - computed
        if not self._keys:
            pairs = [_layer_kv(cache, layer) for layer in range(_num_layers(cache))]
            self._allocate([k for k, _ in pairs], [v for _, v in pairs], width)
        self._ensure_capacity(width)
        # One copy per layer for every admitted row: a row's padding past its own length
        # lands in its slot too, where the decode mask (columns <= len) never reads it.
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        source = torch.tensor(row_of, device=dev)
        for layer, (k_store, v_store) in enumerate(zip(self._keys, self._values)):
            keys, values = _layer_kv(cache, layer)
            k_store[slots, :, :width] = keys[source, :, :width]
            v_store[slots, :, :width] = values[source, :, :width]
        for i, seq in enumerate(seqs):
            self._lens[seq.slot] = len(inputs[i])
        self._sample(seqs, logits[source] if len(distinct) < len(seqs) else logits)

    def _install_kv(self, seq: SequenceState) -> None:
        """Copy a request's cache into its slot, run the tokens it does not cover (all but
        the last) through one forward over it; the sequence decodes from its last token."""
        kv = seq.request.kv
        inputs = seq.input_ids()
        keys = [k.to(self._device) for k in kv.keys]
        values = [v.to(self._device) for v in kv.values]
        n = kv.num_tokens
        rest = inputs[n:-1]
        if rest:
            cache = DynamicCache()
            for layer, (k, v) in enumerate(zip(keys, values)):
                cache.update(k[None], v[None], layer)
            ids = torch.tensor([rest], device=self._device)
            mask = torch.ones((1, n + len(rest)), dtype=torch.long, device=self._device)
            positions = torch.arange(n, n + len(rest), device=self._device)[None]
            self._forward(ids, mask, positions, cache, torch.tensor([0], device=self._device))
            pairs = [_layer_kv(cache, layer) for layer in range(len(keys))]
            keys, values = [k[0] for k, _ in pairs], [v[0] for _, v in pairs]
            self.prefilled_tokens += len(rest)
            n += len(rest)
        self.kv_reused_tokens += kv.num_tokens
        if not self._keys:
            self._allocate([k[None] for k in keys], [v[None] for v in values], n + 1)
        self._ensure_capacity(n + 1)
        for k_store, v_store, k, v in zip(self._keys, self._values, keys, values):
            k_store[seq.slot, :, :n] = k[:, :n]
            v_store[seq.slot, :, :n] = v[:, :n]
        self._lens[seq.slot] = n
        self._pending[seq.slot] = seq.token_ids[-1]
        seq.request.kv = None  # the slot holds it now

    def _allocate(self, keys: list[torch.Tensor], values: list[torch.Tensor],
                  needed: int) -> None:
        """Slot stores shaped like per-layer ``[batch, kv_heads, len, head_dim]`` examples."""
        capacity = min(self._context_length, max(needed, _MIN_CAPACITY))
        for k, v in zip(keys, values):
            shape_k = (self._table.max_batch, k.shape[1], capacity, k.shape[3])
            shape_v = (self._table.max_batch, v.shape[1], capacity, v.shape[3])
            self._keys.append(torch.zeros(shape_k, dtype=k.dtype, device=self._device))
            self._values.append(torch.zeros(shape_v, dtype=v.dtype, device=self._device))
        self._capacity = capacity

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        assert needed <= self._context_length, (needed, self._context_length)
        capacity = min(self._context_length, max(needed, 2 * self._capacity))
        for store in (self._keys, self._values):
            for layer, old in enumerate(store):
                grown = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                grown[:, :, : self._capacity] = old
                store[layer] = grown
        self._capacity = capacity
