"""Offline batch inference with vLLM's interface: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from cb_serve.chat_template import apply_chat_template, split_images
from cb_serve.config import EngineConfig
from cb_serve.engine.gc_heap import frozen_heap
from cb_serve.engine.llm_engine import LLMEngine
from cb_serve.inputs import PromptType, is_single_prompt
from cb_serve.lora_request import LoRARequest
from cb_serve.outputs import RequestOutput
from cb_serve.sampling_params import RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """``LLM(model=None)`` loads the built-in SmolLM2-135M-Instruct; any other keyword is an
    engine argument (see ``EngineConfig`` or ``cb-serve generate --help``)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts to completion, in input order. A prompt is a string, a list of token
        ids, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}`` (vLLM's TextPrompt / TokensPrompt).
        ``lora_request``: one adapter for every prompt, or one (or None: the base model) per prompt.
        ``priority``: one per prompt (``scheduling_policy="priority"``: lower values first)."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"Got {len(prompts)} prompts but {len(params_list)} sampling params.")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"Got {len(prompts)} prompts but {len(loras)} LoRA requests.")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"Got {len(prompts)} prompts but {len(priorities)} priorities.")
        # Validate everything before queueing anything: a bad prompt leaves the engine untouched.
        processed = [self.engine.processor.process(p, sp) for p, sp in zip(prompts, params_list)]
        for req, p in zip(processed, priorities):
            req.priority = self.engine.checked_priority(p)
        read = {}
        for req, lora in zip(processed, loras):  # each adapter read (and checked) once
            if lora is not None:
                req.lora_request = lora
                req.lora_weights = read.get(lora.key) or read.setdefault(lora.key, self.engine.read_lora(lora))
        ids = []
        for req in processed:
            req.params.output_kind = RequestOutputKind.FINAL_ONLY
            ids.append(str(next(self._ids)))
            self.engine.add_processed_request(ids[-1], req)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (or ``chat_template``, with ``chat_template_kwargs``) to
        each conversation (with ``tools``: OpenAI tool objects, rendered by the template or the built-in
        tool prompt), then generates, as vLLM's ``LLM.chat``. Content parts may carry images where the model
        reads them: OpenAI's ``image_url`` (a data URL), or vLLM's ``image_pil`` (a PIL image)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        prompts = [self.apply_chat_template(c, add_generation_prompt, tools, **options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, priority=priority)

    def apply_chat_template(
        self,
        messages: ChatMessages,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **options: Any,
    ) -> PromptType:
        """The conversation's prompt: its token ids, or with images, a ``TokensPrompt`` with their processed
        ``multi_modal_features``. ``options``: ``chat_template``, ``chat_template_kwargs``,
        ``continue_final_message``, ``reasoning_effort`` (``chat_template.apply_chat_template``)."""
        messages, images = split_images(messages)
        tokenizer = self.engine.tokenizer
        if not images:
            return apply_chat_template(tokenizer, messages, add_generation_prompt, tools, **options)
        text = apply_chat_template(tokenizer, messages, add_generation_prompt, tools, tokenize=False, **options)
        ids, features = self.engine.processor.image_prompts("messages").process_chat(text, images)
        return {"prompt_token_ids": ids, "prompt": text, "multi_modal_features": features}

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            with frozen_heap():
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        finally:
            bar.close()
            engine.abort_request([r for r in request_ids if r not in results])
        return [results[r] for r in request_ids]
