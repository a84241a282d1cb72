"""The offline feature store: features captured while generating equal a separate target pass;
builds are incremental and resumable; training vocab cuts keep sampled negatives."""

from __future__ import annotations

import torch

from adaflash.training.feature_store import FeatureStore, StoreWriter, build_store
from adaflash.training.offline import VocabCut
from adaflash.training.responses import ensure_responses
from adaflash.workloads import Prompt

LAYERS = (1, 2)


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"t/{i}", "chat", f"question {i}: {'ab' * (i % 4)}?") for i in range(n)]


def test_captured_features_equal_a_separate_pass_and_builds_are_incremental(tiny32, tmp_path):
    writer = StoreWriter(tiny32, LAYERS, "greedy-24", root=tmp_path / "cap")
    responses = ensure_responses(
        tiny32, _prompts(10), tmp_path / "r.jsonl", 24, batch_size=4, features=writer
    )
    captured = FeatureStore(writer.path)
    assert len(captured) == 10
    seen = []
    fresh = build_store(tiny32, responses, LAYERS, response_set="greedy-24", root=tmp_path / "pass",
                        on_start=lambda n, size: seen.append((n, size)))  # fmt: skip
    assert seen[0][0] == 10 and seen[0][1] > 0
    by_id = {captured.entries[i].id: captured[i] for i in range(len(captured))}
    for i in range(len(fresh)):
        a, b = fresh[i], by_id[fresh[i].id]
        assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
        L = a.tokens.numel()  # the last position is never fed while generating (nor ever read)
        fa, fb = a.features[: L - 1].float(), b.features[: L - 1].float()
        torch.testing.assert_close(fa, fb, rtol=2e-3, atol=2e-3)
    # A second build over more responses stores only the new ones; the view keeps the order.
    more = ensure_responses(tiny32, _prompts(14), tmp_path / "r.jsonl", 24, batch_size=4)
    seen.clear()
    grown = build_store(tiny32, more, LAYERS, response_set="greedy-24", root=tmp_path / "pass",
                        on_start=lambda n, size: seen.append((n, size)))  # fmt: skip
    assert seen[0][0] == 4 and [e.id for e in grown.entries] == [r.id for r in more]
    assert grown.version != fresh.version


def test_vocab_cut_with_negatives():
    cut = VocabCut.from_tokens(50, [torch.tensor([3, 7, 7, 9])], extra=[1])
    assert cut.ids.tolist() == [1, 3, 7, 9] and cut.index[7] == 2 and cut.index[4] == -1
    neg = cut.with_negatives(10, torch.Generator().manual_seed(0))
    assert neg.size == 14 and set(cut.ids.tolist()) <= set(neg.ids.tolist())
    assert (neg.index[neg.ids] == torch.arange(14)).all()


def test_a_store_with_teacher_rows_serves_runs_that_want_fewer(tiny32, tmp_path):
    responses = ensure_responses(tiny32, _prompts(6), tmp_path / "r.jsonl", 16, batch_size=3)
    wide = build_store(tiny32, responses, LAYERS, topk=8, response_set="g", root=tmp_path)
    seen = []
    plain = build_store(tiny32, responses, LAYERS, topk=0, response_set="g", root=tmp_path,
                        on_start=lambda n, size: seen.append(n))  # fmt: skip
    assert seen == [] and plain.path == wide.path and plain[0].topk_ids is None  # no second pass
    four = build_store(tiny32, responses, LAYERS, topk=4, response_set="g", root=tmp_path)
    for i in range(len(wide)):
        a, b = wide[i], four[i]
        assert torch.equal(a.features, b.features) and torch.equal(a.tokens, plain[i].tokens)
        assert b.topk_ids.shape[1] == 4 and torch.equal(a.topk_ids[:, :4], b.topk_ids)
        assert torch.equal(a.topk_logp[:, :4], b.topk_logp)
    # A store that lacks a response is not a cover: the narrower store is built for real.
    more = ensure_responses(tiny32, _prompts(8), tmp_path / "r.jsonl", 16, batch_size=3)
    grown = build_store(tiny32, more, LAYERS, topk=0, response_set="g", root=tmp_path)
    assert grown.path != wide.path and len(grown) == 8


def test_a_store_of_more_target_layers_serves_a_drafter_that_taps_fewer(tiny32, tmp_path):
    """The options table's feature-layer rows read a subset of the stored layers' columns (in the
    drafter's own layer order) instead of a second target pass; a layer the store lacks is built."""
    assert tiny32.config.num_layers == 4
    responses = ensure_responses(tiny32, _prompts(5), tmp_path / "r.jsonl", 16, batch_size=3)
    wide = build_store(tiny32, responses, (0, 1, 2), topk=4, response_set="g", root=tmp_path)
    h = tiny32.config.hidden_size
    seen = []
    for ids in [(0, 2), (2, 1), (1,)]:
        view = build_store(tiny32, responses, ids, topk=0, response_set="g", root=tmp_path,
                           on_start=lambda n, size: seen.append(n))  # fmt: skip
        assert view.path == wide.path and view.key.layer_ids == ids and view.feature_dim == h * len(ids)
        for i in range(len(view)):
            full, part = wide[i].features, view[i].features
            expect = torch.cat([full[:, j * h : (j + 1) * h] for j in ids], dim=1)
            assert torch.equal(part, expect) and part[0].numel() == view.feature_dim
            assert view[i].topk_ids is None and torch.equal(wide[i].tokens, view[i].tokens)
    assert seen == []  # no target pass
    other = build_store(tiny32, responses, (0, 3), topk=0, response_set="g", root=tmp_path,
                        on_start=lambda n, size: seen.append(n))  # fmt: skip
    assert seen == [5] and other.path != wide.path
