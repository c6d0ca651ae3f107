"""``coordexp eval`` and ``/detect/`` give the same score for the same tokens (issue 55 item 5): both read the
distribution the decoder drew from (the repetition penalty, the never-emit mask, coord-group greedy). Regression:
eval scored the plain log-softmax while the server reported processed log-probabilities, so one object scored
1.97e-6 in eval and 2.62e-6 in ``/detect/``."""

from __future__ import annotations

import dataclasses
import math

import pytest

from coordexp.runtime.core.serialize import serialize_objects
from coordexp.runtime.model.encoding import encode_prompt
from coordexp.runtime.rollout.base import RolloutOutput, RolloutRequest
from coordexp.runtime.server.detect import detected_object
from coordexp.runtime.server.engine import GenerationParams, HfEngine
from coordexp.runtime.train.evaluate import score_samples
from coordexp.runtime.train.rollout_step import HostContext, build_rollout_sample
from coordexp.schema.rollout import DecodingConfig


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from packing_kit import load_eval_model

    return load_eval_model(tiny_model_dir)


def _scores(run_contract, model, processor, record, decoding: DecodingConfig) -> tuple[list[float], list[float]]:
    """Each valid object's score of one rollout (the record's ground truth as the model writes it): by eval's
    scorer and by the HF engine's ``/infer/`` log-probabilities read the way ``/detect/`` reads them."""
    rollout = dataclasses.replace(run_contract.rollout_matching, decoding=decoding)
    host = HostContext.create(processor, rollout, run_contract.template)
    prompt = encode_prompt(processor, record, run_contract.template)
    text = serialize_objects(list(record.objects))
    ids = tuple(processor.tokenizer.encode(text, add_special_tokens=False))
    output = RolloutOutput(tuple(prompt.input_ids.tolist()), ids, text, "stop")
    sample = build_rollout_sample(record, prompt, output, host)
    assert sample.valid_positions, "the ground truth parses: there is something to score"
    evaluated = score_samples(model, host, [record], [sample], score="logprob")[0].predictions
    engine = HfEngine(model, processor.tokenizer, decode_batch_size=1, repeat_terminate=rollout.repeat_terminate)
    tokens = engine.token_logprobs([RolloutRequest(prompt, 0, record=record)], [output],
                                   GenerationParams(max_new_tokens=len(ids), decoding=decoding, logprobs=0), 0)[0]
    logprobs = [t.logprob for t in tokens]
    size = (record.width, record.height)
    served = [detected_object(sample.parse.objects[p], size, logprobs, len(ids))["score"]
              for p in sample.valid_positions]
    return [p.score("logprob") for p in evaluated], served


@pytest.mark.parametrize("decoding", [DecodingConfig(), DecodingConfig(repetition_penalty=1.05),
                                      DecodingConfig(repetition_penalty=1.1, coord_group_greedy=True)],
                         ids=["greedy", "repetition_penalty", "coord_group_greedy"])
def test_eval_and_detect_score_the_same_tokens_alike(run_contract, model, processor, records, decoding):
    record = max(records[:8], key=lambda r: len(r.objects))
    evaluated, served = _scores(run_contract, model, processor, record, decoding)
    assert len(evaluated) == len(served) == len(record.objects)
    for a, b in zip(evaluated, served, strict=True):
        if a == 0.0 or b == 0.0:  # coord-group greedy sets the kind it did not choose to -inf: probability 0
            assert a == b == 0.0
        else:
            assert math.log(a) == pytest.approx(math.log(b), abs=1e-3)
    assert decoding.coord_group_greedy or any(a > 0.0 for a in evaluated)


def test_the_penalty_changes_the_score_so_the_agreement_is_not_trivial(run_contract, model, processor, records):
    record = max(records[:8], key=lambda r: len(r.objects))
    plain, _ = _scores(run_contract, model, processor, record, DecodingConfig())
    penalised, _ = _scores(run_contract, model, processor, record, DecodingConfig(repetition_penalty=1.05))
    assert any(abs(math.log(a) - math.log(b)) > 1e-2 for a, b in zip(plain, penalised, strict=True))
