"""A tiny Llama whose greedy output is scripted, for reasoning, chat-template and HTTP tests.

Every layer's ``o_proj`` and ``down_proj`` is zero, so the residual stream at a position is the
embedding of the token there: the logits depend on the current token alone (a bigram model). The
tokens that start a step of the script get orthonormal embeddings (times sqrt(hidden): RMSNorm
leaves them as they are), and the LM head row of each token that follows one is the (scaled)
embedding of its predecessor: after token ``t`` the logit of ``next[t]`` is ``SCALE`` and every
other logit is 0 (up to rounding), whatever came before. So greedy decoding goes down the chain
``next`` from the prompt's last token, in HF ``generate`` and in cb-serve alike.

The tokenizer is SmolLM2's with ``<think>`` and ``</think>`` added (two tokens: the vocabulary
grows by 2) as Qwen3 has them: added tokens, never split, but not "special", so decoding with
``skip_special_tokens`` keeps them in the text (where a reasoning parser reads them). Its chat
template is Qwen3-like: ``<|im_start|>role\\ncontent<|im_end|>\\n`` turns, the generation prompt
``<|im_start|>assistant\\n``, and ``enable_thinking: false`` adds ``<think>\\n\\n</think>\\n\\n``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

THINK_START, THINK_END = "<think>", "</think>"
QWEN3_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CONTENT = '{"answer":4}'  # compact, as structured outputs write JSON
SCRIPT = f"{THINK_START}Let me think{THINK_END}{CONTENT}"
# Where the chain starts: after the generation prompt (its last token is "\n"), the whole script; after
# the empty think block of enable_thinking=false (its last token is "\n\n"), the content alone.
ENTRIES = {"\n": SCRIPT, "\n\n": CONTENT}
SCALE = 32.0  # the logit of the scripted next token; every other logit is ~0


def scripted_tokenizer(
    base_tokenizer, directory: Path, added: tuple[str, ...] = (THINK_START, THINK_END), special: bool = False,
    template: str = QWEN3_LIKE_TEMPLATE,
):  # fmt: skip
    """SmolLM2's tokenizer (``base_tokenizer``, left as it is) with ``added`` tokens (the think tokens) and
    ``template`` (the Qwen3-like one), saved in ``directory``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    base_tokenizer.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens([AddedToken(t, special=special, normalized=False) for t in added], special_tokens=special)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return tokenizer


def script_chain(tokenizer, script: str, entries: Mapping[str, str]) -> tuple[dict[int, int], list[int]]:
    """The chain ``{token: next token}`` that makes greedy decoding say ``script`` then EOS, and the
    script's token ids (EOS included). ``entries``: single-token texts mapped to the suffix of the
    script that follows them. The chain is first order, so each token may start one step only."""
    ids = [*tokenizer.encode(script, add_special_tokens=False), tokenizer.eos_token_id]
    chain: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        if chain.setdefault(a, b) != b:
            raise ValueError(f"token {tokenizer.decode([a])!r} appears twice in the script: its next is ambiguous")
    for text, suffix in entries.items():
        (entry,) = tokenizer.encode(text, add_special_tokens=False)
        tail = tokenizer.encode(suffix, add_special_tokens=False)
        if not tail or ids[len(ids) - 1 - len(tail) : -1] != tail:
            raise ValueError(f"{suffix!r} is not a suffix of the script at a token boundary")
        if chain.setdefault(entry, tail[0]) != tail[0]:
            raise ValueError(f"entry {text!r} is a token of the script with another next token")
    return chain, ids


def make_scripted_model(
    directory: Path,
    base_tokenizer,
    script: str = SCRIPT,
    entries: Mapping[str, str] | None = None,
    hidden_size: int = 64,
    seed: int = 0,
    **tokenizer_setup,
) -> list[int]:
    """Saves the scripted model and its tokenizer in ``directory``: a prompt ending in an entry
    (default ``ENTRIES``: any chat prompt with a generation prompt) is continued greedily with the
    rest of ``script`` then EOS. Returns the script's token ids (EOS included). ``tokenizer_setup``:
    ``scripted_tokenizer``'s tokens and template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = scripted_tokenizer(base_tokenizer, directory, **tokenizer_setup)
    chain, ids = script_chain(tokenizer, script, ENTRIES if entries is None else entries)
    if len(chain) > hidden_size:
        raise ValueError(f"{len(chain)} chain steps need hidden_size >= {len(chain)}")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    _script_weights(model, chain, hidden_size)
    check_margin(model, chain)
    model.save_pretrained(directory)
    return ids


@torch.no_grad()
def _script_weights(model, chain: Mapping[int, int], hidden_size: int) -> None:
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    model.model.norm.weight.fill_(1.0)
    keys = sorted(chain)
    basis, _ = torch.linalg.qr(torch.randn(hidden_size, len(keys), dtype=torch.float64))
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    head.zero_()
    for i, key in enumerate(keys):
        embed[key] = (basis[:, i] * hidden_size**0.5).float()  # RMS 1: the final norm keeps it
        head[chain[key]] += embed[key] * (SCALE / hidden_size)


@torch.no_grad()
def check_margin(model, chain: Mapping[int, int], min_margin: float = SCALE / 2) -> None:
    """Each chain step's float32 logits, through the final RMSNorm: the scripted token wins by
    ``min_margin`` at least."""
    keys = torch.tensor(sorted(chain))
    hidden = model.model.norm(model.model.embed_tokens(keys)[:, None, :])[:, 0]
    logits = model.lm_head(hidden)
    top = logits.topk(2, dim=-1)
    expected = torch.tensor([chain[int(k)] for k in keys])
    assert torch.equal(top.indices[:, 0], expected), "a chain step's argmax is not its scripted token"
    margin = float((top.values[:, 0] - top.values[:, 1]).min())
    assert margin >= min_margin, f"the scripted tokens win by {margin} only"
