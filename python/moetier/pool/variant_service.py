"""Variants of one MoE behind the OpenAI-compatible API (`moetier serve-variants`).

`model` in a request names a variant; /v1/models lists them (each says whether consolidation is on);
/metrics shows the shared cache's slots, hits and reads and the requests per variant. Requests are
answered one at a time (the variants share one cache), in the order they arrive."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import ConfigError, MoetierError
from ..variants import Closed, Variants
from .executor import Answer
from .server import RequestError, completion, parse_request, prompt_refused


class VariantService:
    """Turns API requests into generate calls on the variant they name."""

    def __init__(self, variants: Variants, n_ctx: int) -> None:
        self.variants = variants
        self.n_ctx = n_ctx
        self.failed = 0
        self.reads = 0
        self.hits = 0
        self.lookups = 0
        self._lock = threading.Lock()

    def names(self) -> list[dict[str, Any]]:
        meta = {"kind": "variant", "consolidated": self.variants.consolidated}
        return [{"id": n, "object": "model", "owned_by": "moetier", "moetier": meta} for n in self.variants.names]

    def run(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        req = parse_request(body, chat, self.variants.names, "the variants served")
        # OpenAI's defaults: 16 tokens for a completion; a chat runs until the model stops or its context is full
        max_tokens = req.max_tokens or (self.n_ctx if chat else 16)
        t0 = time.perf_counter()
        try:
            prompt = self.variants.chat_prompt(req.name, req.messages) if req.messages is not None else req.text
            r = self.variants.generate(req.name, prompt, max_tokens, req.temperature, req.seed)
        except Exception as e:  # counted and answered, whatever it is
            with self._lock:
                self.failed += 1
            if isinstance(e, ConfigError) and prompt_refused(e):  # the prompt: the request's
                raise RequestError(400, str(e)) from None
            if isinstance(e, Closed):  # the server is stopping: not run, the client may try again
                raise RequestError(503, f"the server is shutting down; the request was not run ({e})") from None
            why = str(e) if isinstance(e, MoetierError) else f"{type(e).__name__}: {e}"
            raise RequestError(500, why) from None
        with self._lock:
            self.lookups += r.stats.n_lookups
            self.hits += r.stats.n_hits
            self.reads += r.stats.n_bytes_read
        answer = Answer(
            model=req.name,
            text=r.text,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=len(r.tokens),
            finish_reason="stop" if r.stop == "eog" else "length",  # OpenAI's: a full context is a length too
            executor=0,
            queued_seconds=max(0.0, time.perf_counter() - t0 - r.seconds),
            load_seconds=0.0,
            run_seconds=r.seconds,
        )
        meta = {
            "variant": req.name,
            "consolidated": self.variants.consolidated,
            "seconds": round(time.perf_counter() - t0, 4),
            "prefill_seconds": round(r.prefill_seconds, 4),
            "decode_seconds": round(r.decode_seconds, 4),
        }
        return completion(req.name, answer, chat, meta)

    def metrics(self) -> str:
        info = self.variants.cache_info()
        lines = [
            "# TYPE moetier_variants_slots gauge",
            f"moetier_variants_slots {info['n_slots']}",
            "# TYPE moetier_variants_slots_held gauge",
            f"moetier_variants_slots_held {info['n_held']}",
            "# TYPE moetier_variants_cache_bytes gauge",
            f"moetier_variants_cache_bytes {info['cache_bytes']}",
            "# TYPE moetier_variants_consolidated gauge",
            f"moetier_variants_consolidated {int(self.variants.consolidated)}",
            "# TYPE moetier_variants_expert_lookups_total counter",
            f"moetier_variants_expert_lookups_total {self.lookups}",
            "# TYPE moetier_variants_expert_hits_total counter",
            f"moetier_variants_expert_hits_total {self.hits}",
            "# TYPE moetier_variants_bytes_read_total counter",
            f"moetier_variants_bytes_read_total {self.reads}",
            "# TYPE moetier_variants_failed_total counter",
            f"moetier_variants_failed_total {self.failed}",
            "# TYPE moetier_variants_requests_total counter",
        ]
        lines += [f'moetier_variants_requests_total{{variant="{n}"}} {c}' for n, c in self.variants.requests.items()]
        return "\n".join(lines) + "\n"
