"""Per-request logits processors (penalties, logit_bias, allowed_token_ids, bad_words) against independent oracles:

- on random logits, HF transformers' own processors (``RepetitionPenaltyLogitsProcessor`` over prompt and output,
  ``NoBadWordsLogitsProcessor`` fed the output only, as vLLM matches, ``SequenceBiasLogitsProcessor`` with
  one-token sequences) and a plain reference for the presence/frequency penalties and the allowed ids, row by
  row in mixed batches, rows without a processor untouched bit for bit;
- greedy decoding of a tiny random model equals HF ``model.generate`` with ``repetition_penalty``,
  ``sequence_bias`` and ``bad_words_ids``, and a step-by-step HF reference for the other penalties;
- validation: every parameter's range, and token ids against the vocabulary, naming the parameter.
"""

from __future__ import annotations

import pytest
import torch
from models import assert_greedy_match
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from cb_serve import LLM, SamplingParams
from cb_serve.config.speculative import SpeculativeConfig
from cb_serve.errors import InvalidRequestError
from cb_serve.model_executor.logits_processors import LogitsProcessors
from cb_serve.model_executor.sampler import Sampler, SamplingBatch, takes_raw_argmax
from cb_serve.sequence import Sequence
from cb_serve.spec_decode.proposer import DraftProposer
from cb_serve.spec_decode.speculator import Speculator

VOCAB = 64
GEN = torch.Generator().manual_seed(0)


def make_seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("s", "r", 0, prompt, SamplingParams(temperature=0, max_tokens=64, **params), 64)
    seq.token_ids.extend(output)
    return seq


def tokens(n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=GEN).tolist()


def processed(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    LogitsProcessors.from_seqs(seqs).apply(out)
    return out


def hf(processor, input_ids: list[int], row: torch.Tensor) -> torch.Tensor:
    return processor(torch.tensor([input_ids], dtype=torch.long), row[None].clone())[0]


def presence_frequency(row: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition, over the output's tokens only."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=row.shape[-1]).float()
    return row - frequency * counts - presence * (counts > 0)


def test_repetition_penalty_equals_hf_over_prompt_and_output():
    seqs = [make_seq(tokens(12), tokens(n), repetition_penalty=p) for n, p in [(0, 1.3), (5, 0.7), (20, 2.0)]]
    logits = torch.randn(len(seqs), VOCAB, generator=GEN) * 3
    ours = processed(seqs, logits)
    for row, seq in enumerate(seqs):
        expected = hf(RepetitionPenaltyLogitsProcessor(seq.params.repetition_penalty), seq.token_ids, logits[row])
        assert torch.equal(ours[row], expected), row
        assert not torch.equal(ours[row], logits[row])


def test_bad_words_equal_hf_on_the_output_tokens():
    """vLLM bans a bad word's last token where its other tokens end the output; the prompt does not count
    (HF matches over all its input ids: it is fed the output only)."""
    words = ((7,), (1, 4), (2, 3, 5))
    cases = [([9, 9, 1], []), ([2, 3], [8, 1]), ([9], [2, 3]), ([2], [3, 2, 3]), ([1], [6])]
    seqs = [make_seq(prompt, output, bad_words_token_ids=words) for prompt, output in cases]
    logits = torch.randn(len(seqs), VOCAB, generator=GEN)
    ours = processed(seqs, logits)
    for row, seq in enumerate(seqs):
        output = seq.token_ids[seq.num_prompt_tokens :]
        expected = hf(NoBadWordsLogitsProcessor([list(w) for w in words]), output, logits[row])
        assert torch.equal(ours[row], expected), row
    banned = [set((ours[row] == float("-inf")).nonzero().flatten().tolist()) for row in range(len(seqs))]
    assert banned == [{7}, {7, 4}, {7, 5}, {7, 5}, {7}]  # row 0: its prompt ends in 1, 4 stays


def test_logit_bias_equals_hf_sequence_bias():
    bias = {3: 2.5, 10: -7.0, 63: 250.0, 0: -1e9}  # clamped to [-100, 100]
    seqs = [make_seq(tokens(4), tokens(3), logit_bias=bias), make_seq(tokens(4), [], logit_bias={5: 1.0})]
    assert seqs[0].params.logit_bias == {3: 2.5, 10: -7.0, 63: 100.0, 0: -100.0}
    logits = torch.randn(2, VOCAB, generator=GEN)
    ours = processed(seqs, logits)
    for row, seq in enumerate(seqs):
        sequence_bias = {(t,): b for t, b in seq.params.logit_bias.items()}
        assert torch.equal(ours[row], hf(SequenceBiasLogitsProcessor(sequence_bias), seq.token_ids, logits[row]))


def test_presence_and_frequency_penalties_count_the_output_only():
    settings = [dict(presence_penalty=0.5), dict(frequency_penalty=1.5), dict(presence_penalty=-2, frequency_penalty=2)]
    seqs = [make_seq(tokens(30), tokens(n), **s) for n, s in zip([0, 9, 40], settings)]
    logits = torch.randn(len(seqs), VOCAB, generator=GEN)
    ours = processed(seqs, logits)
    for row, (seq, s) in enumerate(zip(seqs, settings)):
        output = seq.token_ids[seq.num_prompt_tokens :]
        expected = presence_frequency(logits[row], output, s.get("presence_penalty", 0), s.get("frequency_penalty", 0))
        assert torch.equal(ours[row], expected), row


def test_allowed_token_ids_keep_only_those_tokens():
    seqs = [make_seq([1], [], allowed_token_ids=[5, 2, 5, 40]), make_seq([1], [], allowed_token_ids=[63])]
    logits = torch.randn(2, VOCAB, generator=GEN)
    ours = processed(seqs, logits)
    for row, allowed in enumerate([[2, 5, 40], [63]]):
        expected = torch.full((VOCAB,), float("-inf"))
        expected[allowed] = logits[row, allowed]
        assert torch.equal(ours[row], expected)


def every_processor(prompt: list[int], output: list[int], logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's order, from HF's processors and the plain references: allowed ids, bad words, bias, penalties."""
    x = torch.full_like(logits, float("-inf"))
    x[p.allowed_token_ids] = logits[p.allowed_token_ids]
    x = hf(NoBadWordsLogitsProcessor([list(w) for w in p.bad_words_token_ids]), output, x)
    x = hf(SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}), prompt + output, x)
    x = hf(RepetitionPenaltyLogitsProcessor(p.repetition_penalty), prompt + output, x)
    return presence_frequency(x, output, p.presence_penalty, p.frequency_penalty)


def test_a_mixed_batch_processes_each_row_alone_and_leaves_the_others():
    everything = dict(
        allowed_token_ids=list(range(0, VOCAB, 2)),
        bad_words_token_ids=((4,), (9, 6)),
        logit_bias={6: 3.0, 8: -2.0, 7: 50.0},
        repetition_penalty=1.4,
        presence_penalty=0.3,
        frequency_penalty=0.2,
    )
    settings = [
        {},
        dict(repetition_penalty=1.2),
        dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={}),  # all neutral
        dict(logit_bias={1: 5.0}),
        everything,
        dict(bad_words_token_ids=((3,),)),
        dict(frequency_penalty=0.7),
    ]
    seqs = [make_seq(tokens(10), tokens(8) + [9], **s) for s in settings]
    logits = torch.randn(len(seqs), VOCAB, generator=GEN) * 2
    ours = processed(seqs, logits)
    for row in (0, 2):
        assert torch.equal(ours[row], logits[row]), "a row without processors changed"
        assert not seqs[row].params.has_logits_processors
    for row, seq in enumerate(seqs):
        if seq.params.has_logits_processors:
            assert torch.equal(ours[row], processed([seq], logits[row : row + 1])[0]), row
    seq = seqs[4]
    prompt, output = seq.prompt_token_ids, seq.token_ids[seq.num_prompt_tokens :]
    assert torch.equal(ours[4], every_processor(prompt, output, logits[4], seq.params))
    assert ours[4, 6] == float("-inf")  # the bad word (9, 6) completes: its bias cannot bring it back


def test_the_sampler_applies_them_after_min_tokens_and_logprobs_see_raw_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5, 2.0]])
    seq = make_seq([2], [], logit_bias={1: 100.0, 3: 10.0}, allowed_token_ids=[1, 2, 3], min_tokens=2)
    seq.min_tokens_banned = [1]  # the EOS, banned until min_tokens
    batch = SamplingBatch.from_seqs([seq])
    assert batch.banned == [(0, [1])] and batch.processors is not None
    batch.num_logprobs = [1]
    out = Sampler()(logits.clone(), batch)
    assert out.token_ids == [3]  # 1 banned, 4 not allowed, 3 biased up
    assert set(out.logprobs[0]) == {1, 3} and out.logprobs[0][1].rank == 1  # of the raw logits


def test_processors_turn_off_the_raw_argmax_and_speculation():
    plain = make_seq([1, 2], [3])
    assert LogitsProcessors.from_seqs([plain, plain]) is None and takes_raw_argmax([plain])
    spec = Speculator(SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}), 128, 64)
    plain.num_computed_tokens = plain.num_tokens - 1
    assert spec.num_drafts_for(plain) == 2
    for kwargs in [
        dict(repetition_penalty=1.1),
        dict(presence_penalty=0.1),
        dict(frequency_penalty=-0.1),
        dict(logit_bias={1: 0.5}),
        dict(allowed_token_ids=[1]),
        dict(bad_words_token_ids=((1, 2),)),
    ]:
        seq = make_seq([1, 2], [3], **kwargs)
        seq.num_computed_tokens = seq.num_tokens - 1
        assert seq.params.has_logits_processors and not takes_raw_argmax([plain, seq]), kwargs
        assert spec.num_drafts_for(seq) == 0, kwargs


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty="1"), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=["a", 3]), "bad_words"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_sampling_params_validate_each_processor(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_token_ids_are_checked_against_the_vocabulary(tiny_llm):
    processor = tiny_llm.engine.processor
    vocab = processor.vocab_size
    for kwargs, param in [
        (dict(logit_bias={vocab: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[0, vocab + 5]), "allowed_token_ids"),
        (dict(prompt_logprobs=tiny_llm.engine.config.max_logprobs + 1), "prompt_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            tiny_llm.generate([[1, 2, 3]], SamplingParams(**kwargs), use_tqdm=False)
        assert e.value.param == param
    ok = processor.process([1, 2], SamplingParams(logit_bias={vocab - 1: 1.0}, allowed_token_ids=[0, vocab - 1]))
    assert ok.params.has_logits_processors


def test_bad_words_tokenize_as_vllm(tiny_llm):
    """Each word left-stripped, and again after a space where that gives another first token and as many tokens."""
    tok = tiny_llm.get_tokenizer()
    words = ["hello", "  world", "Zyzzyva quux", "hello"]
    params = tiny_llm.engine.processor.process([1, 2], SamplingParams(bad_words=words)).params
    expected = []
    for word in dict.fromkeys(words):
        plain = tuple(tok.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word.lstrip(), add_special_tokens=False))
        expected += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
    assert params.bad_words_token_ids == tuple(expected) and len(expected) > len(set(words))
    with pytest.raises(InvalidRequestError) as e:
        tiny_llm.engine.processor.process([1, 2], SamplingParams(bad_words=[f"w{i}" for i in range(100)]))
    assert e.value.param == "bad_words"  # 200 sequences after tokenization, over vLLM's 128


# ---- greedy decoding of a tiny random model against HF transformers


MAX_TOKENS = 16
PROMPTS = [list(range(300, 340)), [500, 501, 502, 500, 501, 502, 500, 501, 502, 500, 501]]


@pytest.fixture(scope="module")
def hf_llama(random_model_dir):
    model = AutoModelForCausalLM.from_pretrained(random_model_dir("llama"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return model


def ours(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def hf_generate(model, prompt: list[int], **kwargs) -> tuple[list[int], torch.Tensor]:
    """HF's greedy tokens and the processed scores it picked them from (for the near-tie rule)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kwargs,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack(out.scores)[:, 0]


def step_by_step(model, prompt: list[int], process) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding from HF's logits of the whole sequence at each step, through ``process(logits, output)``."""
    output, scores = [], []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
        scores.append(process(logits, list(output)))
        output.append(int(scores[-1].argmax()))
    return output, torch.stack(scores)


def test_repetition_penalty_logit_bias_and_bad_words_equal_hf_generate(tiny_llm, hf_llama):
    plain = ours(tiny_llm, PROMPTS, [greedy()] * len(PROMPTS))
    changed = set()  # the settings that changed some output
    for i, (prompt, base) in enumerate(zip(PROMPTS, plain)):
        bias = {base[1]: -4.0, base[3]: -2.5, 1000 + i: 6.0}
        tok = tiny_llm.get_tokenizer()
        words = [tok.decode([base[2]]), tok.decode(base[5:7])]
        bad = tiny_llm.engine.processor.process(prompt, greedy(bad_words=words)).params.bad_words_token_ids
        assert not {t for w in bad for t in w[:-1]} & set(prompt), "HF would match a bad word across the prompt"
        cases = [
            (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
            (dict(repetition_penalty=0.6), dict(repetition_penalty=0.6)),
            (dict(logit_bias=bias), dict(sequence_bias={(t,): b for t, b in bias.items()})),
            (dict(bad_words=words), dict(bad_words_ids=[list(w) for w in bad])),
        ]
        for kwargs, hf_kwargs in cases:
            tokens = ours(tiny_llm, [prompt], [greedy(**kwargs)])[0]
            ref, scores = hf_generate(hf_llama, prompt, **hf_kwargs)
            assert_greedy_match(tokens, ref, scores, f"prompt {i}, {kwargs}")
            if tokens != base:
                changed.add(str(sorted(kwargs)) + str(kwargs.get("repetition_penalty")))
    assert len(changed) == 4, changed


def written_out(params: SamplingParams, prompt: list[int], vocab: int):
    """``process(logits, output)`` of ``step_by_step``: allowed ids, bias and the penalties, one after the other."""

    def process(logits: torch.Tensor, output: list[int]) -> torch.Tensor:
        if params.allowed_token_ids:
            x = torch.full((vocab,), float("-inf"))
            x[params.allowed_token_ids] = logits[params.allowed_token_ids]
            logits = x
        for t, b in (params.logit_bias or {}).items():
            logits[t] += b
        seen = torch.tensor(prompt + output)
        rep = params.repetition_penalty
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / rep, logits[seen] * rep)
        return presence_frequency(logits, output, params.presence_penalty, params.frequency_penalty)

    return process


def test_presence_frequency_and_every_processor_equal_a_step_by_step_reference(tiny_llm, hf_llama):
    prompt = PROMPTS[1]
    base = ours(tiny_llm, [prompt], [greedy()])[0]
    everything = dict(
        allowed_token_ids=sorted(set(base) | set(range(400, 900))),
        logit_bias={base[0]: -3.0, 450: 2.0},
        repetition_penalty=1.3,
        presence_penalty=0.8,
        frequency_penalty=0.4,
    )
    for kwargs in [dict(presence_penalty=1.5), dict(frequency_penalty=2.0), dict(presence_penalty=-1.0), everything]:
        params = tiny_llm.engine.processor.process(prompt, greedy(**kwargs)).params  # as the engine has it
        tokens = ours(tiny_llm, [prompt], [params])[0]
        ref, scores = step_by_step(hf_llama, prompt, written_out(params, prompt, hf_llama.config.vocab_size))
        assert_greedy_match(tokens, ref, scores, str(kwargs))
        assert tokens != base, f"{kwargs} did not change the output"


def test_a_batch_mixing_processors_and_plain_requests_gives_each_its_own_tokens(tiny_llm):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    params = [
        greedy(),
        greedy(repetition_penalty=1.4),
        greedy(logit_bias={1000: 5.0}, presence_penalty=0.5),
        greedy(),
        greedy(bad_words=["the", "and"], frequency_penalty=1.0, logprobs=2),
    ]
    alone = [ours(tiny_llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert ours(tiny_llm, prompts, params) == alone


class ContinuationProposer(DraftProposer):
    """Drafts ``continuation`` (the plain greedy output) for every sequence it is asked about, and records them."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation, self.asked = continuation, []

    def propose(self, seqs: list[Sequence], num_drafts: list[int]) -> list[list[int]]:
        self.asked += seqs
        return [self.continuation[seq.num_output_tokens :][:k] for seq, k in zip(seqs, num_drafts)]


def test_a_request_with_processors_gets_no_drafts(random_model_dir, tiny_llm):
    """Drafts are verified without the processors (they depend on the tokens before each position): such a
    request decodes one token a step beside a plain one that speculates, with the tokens it gets without drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(random_model_dir("llama")), speculative_config=spec, max_model_len=128)
    prompt = PROMPTS[1]
    params = [greedy(), greedy(repetition_penalty=1.3), greedy(logit_bias={501: -50.0}, bad_words=["the"])]
    expected = ours(tiny_llm, [prompt] * 3, params)
    proposer = llm.engine.speculator.proposer = ContinuationProposer(expected[0])
    assert ours(llm, [prompt] * 3, params) == expected
    assert proposer.asked and not any(seq.params.has_logits_processors for seq in proposer.asked)
    assert llm.engine.speculator.counters.num_accepted_tokens > 0  # the plain request did speculate


def test_only_grammars_prompt_logprobs_and_longer_bad_words_need_the_host_each_step():
    """Async scheduling runs a request ahead unless the host must see its last token first: penalties take it on
    the device, ``min_tokens`` needs the output's length, a bias or one-token bad word no tokens at all."""
    assert not SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=3).needs_host_each_step
    assert not SamplingParams(logit_bias={3: 1.0}, allowed_token_ids=[3, 4]).needs_host_each_step
    assert not SamplingParams(bad_words_token_ids=((5,), (9,))).needs_host_each_step
    assert SamplingParams(bad_words_token_ids=((5,), (6, 7))).needs_host_each_step
    assert SamplingParams(prompt_logprobs=0).needs_host_each_step
