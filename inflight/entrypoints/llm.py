"""Offline inference: ``LLM(...).generate(prompts, sampling_params)``, vLLM's API shape."""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any, Sequence, cast

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.outputs import RequestOutput
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """A thin loop over ``Engine``: add every prompt, step until all finish.

    Args:
        model: a ``.gguf`` file or HF model directory; None loads the bundled
            SmolLM2-135M-Instruct GGUF.
        **engine_args: any ``EngineConfig`` field (``max_num_seqs``, ``block_size``, ...).

    Raises:
        ValueError: an invalid engine argument (the message names it).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (the engine's)."""
        tokenizer: Tokenizer = self.engine.tokenizer
        return tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_name: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate completions for ``prompts``.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts or one per prompt (default greedy-free
                ``SamplingParams()``: temperature 1, 16 tokens, as vLLM).
            use_tqdm: show a progress bar.
            lora_name: the LoRA adapter (a name of ``lora_config.lora_modules``) for all
                prompts or one per prompt (None: the base model); vLLM's ``lora_request``.

        Returns:
            One ``RequestOutput`` per prompt, in input order.

        Raises:
            ValueError: a bad prompt (empty, too long) or mismatched parameter count; no
                request is left queued.
        """
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        names = (list(lora_name) if lora_name is not None and not isinstance(lora_name, str)
                 else [lora_name] * len(prompts))
        if len(names) != len(prompts):
            raise ValueError(f"lora_name: {len(names)} given for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p, name in zip(prompts, params, names):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, options=RequestOptions(lora_name=name))
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()  # collect the aborted outputs so nothing lingers
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str = "last",
              use_tqdm: bool = True) -> list[RequestOutput]:
        """Embed ``prompts`` (vLLM's ``LLM.embed``): each output's ``embedding`` is the
        prompt's pooled final hidden state, L2-normalized (``SamplingParams.pooling``:
        ``"last"`` token, vLLM's default for a decoder model, or ``"mean"``).

        Returns:
            One ``RequestOutput`` per prompt, in input order, ``embedding`` of
            ``hidden_size`` floats.

        Raises:
            ValueError: a bad prompt or an unknown ``pooling``.
        """
        params = SamplingParams(max_tokens=0, pooling=pooling)
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat
        template. Raises ``ValueError`` for a model without a template or bad messages."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                steps = self.engine.get_stats().num_steps
                outputs = self.engine.step()
                if not outputs and self.engine.get_stats().num_steps == steps:
                    time.sleep(0.001)  # the dynamic policy is holding a batch back
                for out in outputs:
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [results[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    ids = [t for t in items if isinstance(t, int)]
    if items and len(ids) == len(items):
        return [ids]
    # Not all token ids: a list of prompts, passed on as given (add_request checks each).
    return cast(list[Prompt], items)
