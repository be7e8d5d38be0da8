"""A vLLM KV connector that moves a request's KV from a prefill vLLM to a decode vLLM
through kvfence.

Each vLLM process embeds a kvfence worker (``kvfence.Worker``): the prefill vLLM a prefilld,
the decode vLLM a decoded, both registered with kvctld. kvctld admits a request (pages on
both sides, or neither) before anything else happens, so a rejected request never reaches
either vLLM. Then:

1. kvctld asks the prefilld inside the prefill vLLM for the prompt's KV. Its job thread sends
   the prompt to its own vLLM server (``max_tokens=1``, ``kv_transfer_params`` naming the
   kvfence owner); when that prefill's last prompt token is computed, ``wait_for_save``
   copies the request's blocks out and delivers them. prefilld writes its pages and their
   digests, as for any request.
2. The decoded inside the decode vLLM pulls the pages, verifies coverage and every digest
   against its reservation, and only then copies the KV out for the engine (fail closed:
   a request that fails verification has no KV to load, and kvctld fails it).
3. The proxy (``kvfence.proxy``) then sends the request to the decode vLLM with the owner in
   ``kv_transfer_params``. ``start_load_kv`` takes the verified KV (once, checked against the
   request's prompt) and writes it into the request's blocks before the forward pass reads
   them; without verified KV it reports the blocks as failed, and vLLM's ``fail`` policy
   ends the request with an error. It never decodes from a block nothing was loaded into.

Both copies are synchronous (the save finishes before ``wait_for_save`` returns, the load
before ``start_load_kv`` returns), so vLLM frees a block only when no transfer can touch
it: kvfence's own pages carry the KV between the engines, under kvfence's lifetimes.

``kv_transfer_config``::

    {"kv_connector": "KvfenceConnector", "kv_connector_module_path": "kvfence.connector",
     "kv_role": "kv_producer" | "kv_consumer",
     "kv_connector_extra_config": {"config": "/etc/kvfence/kvfence.toml",
                                   "worker_id": "prefill-0",
                                   "engine_url": "http://127.0.0.1:8100"}}

The decode vLLM's port must be reachable by the proxy alone: an owner is not a secret, and
verified KV goes to the request that names it (README, "kvfence under vLLM").

``engine_url`` (prefill only) is the vLLM server the connector runs in. The KV cache must be
float32 (``--dtype float32``) and prefix caching off on both. With ``KVFENCE_TIMINGS`` set
to a file, each side appends one JSON line per request with its timings.
"""

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from . import Worker

logger = init_logger(__name__)

PARAMS_KEY = "kvfence"


def owner_of(params: Optional[dict]) -> Optional[tuple]:
    """The kvfence owner ``(request, generation)`` named by ``kv_transfer_params``."""
    if not params or PARAMS_KEY not in params:
        return None
    o = params[PARAMS_KEY]
    return int(o["request"]), int(o["generation"])


def now_us() -> int:
    return time.time_ns() // 1000


def record(event: dict) -> None:
    path = os.environ.get("KVFENCE_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


@dataclass
class Transfer:
    owner: tuple
    prompt: list
    block_ids: list
    # Positions [start, end) to load (decode); the whole prompt is saved (prefill).
    start: int = 0
    end: int = 0


@dataclass
class KvfenceMetadata(KVConnectorMetadata):
    saves: list = field(default_factory=list)
    loads: list = field(default_factory=list)


class KvfenceConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self._producer = cfg.is_kv_producer
        extra = cfg.kv_connector_extra_config or {}
        self._extra = extra
        self._block_size = vllm_config.cache_config.block_size
        served = vllm_config.model_config.served_model_name
        if isinstance(served, (list, tuple)):
            served = served[0]
        self._served = extra.get("served_model") or served or vllm_config.model_config.model
        self._vocab = vllm_config.model_config.get_vocab_size()
        # scheduler side
        self._producing: dict[str, Transfer] = {}
        self._need_load: dict[str, Transfer] = {}
        # worker side
        self._worker: Optional[Worker] = None
        self._layers: list[torch.Tensor] = []
        self._load_errors: set[int] = set()

    # ---------------------------------------------------------------- scheduler side

    def on_new_request(self, request) -> None:
        owner = owner_of(request.kv_transfer_params)
        if owner is not None and self._producer:
            prompt = list(request.prompt_token_ids or [])
            self._producing[request.request_id] = Transfer(owner, prompt, [])

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self._producer:
            return 0, False
        owner = owner_of(request.kv_transfer_params)
        if owner is None:
            return 0, False
        # Everything but the last prompt token, which this vLLM computes for the first
        # token's logits.
        prompt = list(request.prompt_token_ids or [])
        return max(len(prompt) - 1 - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if self._producer or num_external_tokens <= 0:
            return
        owner = owner_of(request.kv_transfer_params)
        prompt = list(request.prompt_token_ids or [])
        start = request.num_computed_tokens
        self._need_load[request.request_id] = Transfer(
            owner, prompt, [], start=start, end=start + num_external_tokens
        )

    def build_connector_meta(self, scheduler_output):
        meta = KvfenceMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            t = self._need_load.pop(new.req_id, None)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                meta.loads.append(t)
            t = self._producing.get(new.req_id)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                self._maybe_save(meta, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._producing.get(req_id)
            if t is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    t.block_ids = list(new_blocks[0])
                else:
                    t.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        # A load whose request was not scheduled this step stays for the next.
        return meta

    def _maybe_save(self, meta, req_id, computed):
        t = self._producing[req_id]
        if computed >= len(t.prompt):
            meta.saves.append(self._producing.pop(req_id))

    def request_finished(self, request, block_ids):
        self._producing.pop(request.request_id, None)
        self._need_load.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        def index(name):
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        self._layers = [kv_caches[n] for n in sorted(kv_caches, key=index)]
        extra = self._extra
        role = "prefill" if self._producer else "decode"
        self._worker = Worker(
            role,
            extra["config"],
            model_id=f"vllm:{self._served}",
            vocab=self._vocab,
            worker_id=extra.get("worker_id"),
        )
        g = self._worker.geometry()
        shape = tuple(self._layers[0].shape)
        want = (g["kv_heads"], self._block_size, 2 * g["head_dim"])
        if len(self._layers) != g["layers"] or shape[1:] != want or self._layers[0].dtype != torch.float32:
            self._worker.stop()
            raise ValueError(
                f"kvfence [geometry] {g} does not match vLLM's KV cache: {len(self._layers)} layers "
                f"of {shape} {self._layers[0].dtype}, want {g['layers']} of [blocks, {want}] float32"
            )
        self._probe_layout(self._layers[0].dtype, g["head_dim"])
        if self._producer:
            threading.Thread(target=self._serve_jobs, name="kvfence-jobs", daemon=True).start()
        logger.info("kvfence %s worker started (%s)", role, g)

    def _probe_layout(self, dtype, heads_dim):
        """Where the attention backend keeps each (slot, dim) of K and of V inside one block
        of one head: written through the backend's own cache op, then read back. The CPU
        backend stores K dim-major and V slot-major; asking it keeps the connector right for
        whichever layout its ISA uses."""
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        b, d = self._block_size, heads_dim
        isa = _get_attn_isa(dtype, b, d)
        cache = torch.zeros(1, 1, b, 2 * d, dtype=dtype)
        kc, vc = cache.view(1, 1, 2 * b, d).chunk(2, dim=2)
        marks = torch.arange(1, b * d + 1, dtype=dtype).view(b, 1, d)
        torch.ops._C.cpu_attn_reshape_and_cache(marks, -marks, kc, vc, torch.arange(b), isa)
        flat = cache.view(-1)
        where = torch.empty(2 * b * d, dtype=torch.long)
        where[(flat.abs() - 1).long() + (flat < 0).long() * b * d] = torch.arange(2 * b * d)
        if sorted(where.tolist()) != list(range(2 * b * d)):
            raise ValueError("the attention backend's KV block layout could not be read")
        # [2, block_size, head_dim] -> offset inside the block's flat tile
        self._where = where.view(2, b, d)

    def _tiles(self, layer: torch.Tensor) -> torch.Tensor:
        """[blocks, kv_heads, block_size, 2*head_dim] as [blocks, kv_heads, tile]."""
        nb, h, b, d2 = layer.shape
        return layer.view(nb, h, b * d2)

    def _serve_jobs(self):
        url = self._extra["engine_url"].rstrip("/") + "/v1/completions"
        while self._worker is not None and self._worker.stopped() is None:
            job = self._worker.next_job(200)
            if job is None:
                continue
            request, generation, prompt = job
            body = {
                "model": self._served,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {PARAMS_KEY: {"request": request, "generation": generation}},
            }
            started = now_us()
            try:
                req = urllib.request.Request(
                    url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=60) as r:
                    r.read()
                record({"side": "prefill", "request": request, "generation": generation,
                        "engine_prefill_us": now_us() - started})
            except (urllib.error.URLError, OSError, ValueError) as e:
                try:
                    self._worker.fail(request, generation, f"prefill vLLM at {url}: {e}")
                except Exception:  # the prefill stopped waiting already
                    pass

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for t in meta.loads:
            self._load(t)

    def _load(self, t: Transfer) -> None:
        request, generation = t.owner
        started = now_us()
        got = self._worker.take_verified(request, generation)
        if got is None or got[0] != len(t.prompt) or got[1] != t.prompt[-1]:
            why = "no verified KV" if got is None else "verified KV of another prompt"
            logger.error("kvfence: request %s/%s: %s; failing it", request, generation, why)
            self._load_errors.update(t.block_ids)
            record({"side": "decode", "request": request, "generation": generation, "error": why})
            return
        prompt_len, _, data, exported_us = got
        g = self._worker.geometry()
        kv = torch.frombuffer(bytearray(data), dtype=torch.float32).view(
            g["layers"], 2, g["kv_heads"], prompt_len, g["head_dim"]
        )
        b = self._block_size
        pos = t.start
        while pos < t.end:
            block = t.block_ids[pos // b]
            lo = pos % b
            n = min(b - lo, t.end - pos)
            src = kv[:, :, :, pos : pos + n]  # [layers, K|V, heads, n, dim]
            at = self._where[:, lo : lo + n].reshape(-1)  # K then V offsets of those slots
            for layer, cache in enumerate(self._layers):
                self._tiles(cache)[block][:, at] = src[layer].transpose(0, 1).reshape(src.shape[2], -1)
            pos += n
        record({"side": "decode", "request": request, "generation": generation,
                "exported_unix_us": exported_us, "loaded_unix_us": now_us(),
                "load_us": now_us() - started, "tokens": t.end - t.start})

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for t in meta.saves:
            self._save(t)

    def _save(self, t: Transfer) -> None:
        request, generation = t.owner
        n = len(t.prompt)
        nblk = (n + self._block_size - 1) // self._block_size
        blocks = torch.tensor(t.block_ids[:nblk])
        where = self._where.reshape(-1)
        per_layer = []
        for cache in self._layers:
            tiles = self._tiles(cache)[blocks][:, :, where]  # [blocks, heads, 2*b*dim] in order
            h = tiles.shape[1]
            v = tiles.view(nblk, h, 2, self._block_size, -1)  # [blocks, heads, K|V, b, dim]
            v = v.permute(2, 1, 0, 3, 4).reshape(2, h, nblk * self._block_size, -1)[:, :, :n]
            per_layer.append(v)
        kv = torch.stack(per_layer).contiguous()
        try:
            self._worker.deliver(request, generation, t.prompt, kv.numpy().tobytes())
            record({"side": "prefill", "request": request, "generation": generation,
                    "delivered_unix_us": now_us()})
        except Exception as e:  # the prefill stopped waiting (abandoned or past its deadline)
            logger.warning("kvfence: request %s/%s: %s", request, generation, e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        w, self._worker = self._worker, None
        if w is not None:
            w.stop()
