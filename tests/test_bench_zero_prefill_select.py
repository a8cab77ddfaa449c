"""bench/zero_prefill_select.py's harness on tiny models: recomputing every block token reproduces
the exact splice, and with one layer (whose KV does not depend on the context) every selection
does; the selections pick what they say."""

import json

import pytest
import torch

from .helpers import load_script, one_layer_model, tiny_model

bench = load_script("bench/zero_prefill_select.py")
cases = load_script("bench/zero_prefill_cases.py")


def _report(model, tok, capsys, plot_path=None, probe_layers=(1,), keep_probe_kv=False, piece_prefix="none"
            ) -> dict:
    assert bench.report(model, tok, examples=3, shares=[0.25, 0.5], tokens=6, plot_path=plot_path,
                        probe_layers=probe_layers, keep_probe_kv=keep_probe_kv, piece_prefix=piece_prefix) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2].startswith("| recompute |")
    result = json.loads(lines[-1])
    assert result["bench"] == "zero_prefill_select" and result["examples"] == 3
    assert result.get("piece_prefix", "none") == piece_prefix
    return result["variants"]


def test_recomputing_every_token_is_the_exact_splice(tok_special, capsys, tmp_path):
    variants = _report(tiny_model(len(tok_special), seed=3), tok_special, capsys, plot_path=str(tmp_path / "p.png"),
                       probe_layers=(0, 1))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(variants) == {"none@0", "all@1", *(f"{r}@{s}" for s in (0.25, 0.5)
                                                  for r in ("tail", "deviation@0", "deviation@1", "deviation@all"))}
    exact = variants["all@1"]
    assert exact["recomputed_pct"] == 100.0 and exact["top1_agreement_pct"] == 100.0
    assert exact["identical_pct"] == 100.0 and abs(exact["extra_nll_per_token"]) < 1e-3
    assert variants["none@0"]["recomputed_pct"] < 5  # the last token only
    for s in (0.25, 0.5):
        shares = {variants[f"{r}@{s}"]["recomputed_pct"] for r in ("tail", "deviation@1", "deviation@all")}
        assert len(shares) == 1 and 100 * s <= shares.pop() < 100 * s + 5  # equal budgets, rounded up
    assert variants["none@0"]["extra_nll_per_token"] > 0.01  # the stored KV alone changes the answer


def test_with_one_layer_every_selection_is_exact(tok_special, capsys):
    variants = _report(one_layer_model(len(tok_special), seed=4), tok_special, capsys, probe_layers=(0,))
    for name, v in variants.items():
        if name != "none@0":
            assert v["top1_agreement_pct"] == 100.0 and v["identical_pct"] == 100.0, name
            assert abs(v["extra_nll_per_token"]) < 1e-3, name


def test_keeping_the_probe_kv_of_every_layer_is_exact(tok_special, capsys):
    """On a two-layer model, ``deviation@1+probe`` keeps the in-context KV of every layer: whatever
    it selects, it is the exact splice; ``deviation@0+probe`` keeps layer 0's only, and is not."""
    variants = _report(tiny_model(len(tok_special), seed=3), tok_special, capsys, probe_layers=(0, 1),
                       keep_probe_kv=True)
    for s in (0.25, 0.5):
        kept_all, stale = variants[f"deviation@1+probe@{s}"], variants[f"deviation@1@{s}"]
        assert kept_all["identical_pct"] == 100.0 and abs(kept_all["extra_nll_per_token"]) < 1e-3
        assert kept_all["recomputed_pct"] == stale["recomputed_pct"]  # the same selection
        assert stale["extra_nll_per_token"] > 0.01 and variants[f"deviation@0+probe@{s}"]["extra_nll_per_token"] > 0.01


def test_pieces_after_the_system_turn(tok_special, capsys):
    """``--piece-prefix system``: the pieces' KV changes, the harness's check still holds."""
    model = tiny_model(len(tok_special), seed=3)
    alone = _report(model, tok_special, capsys)
    after = _report(model, tok_special, capsys, piece_prefix="system")
    assert after["all@1"]["identical_pct"] == 100.0 and abs(after["all@1"]["extra_nll_per_token"]) < 1e-3
    assert after["tail@0.25"]["extra_nll_per_token"] != alone["tail@0.25"]["extra_nll_per_token"]
    spec = cases.MarkerSpec.special_token()
    turn, prompt = cases.system_turn(tok_special, spec), cases.build_prompt(tok_special, "Who?", spec,
                                                                             system=cases.MARKER_ADAPTER_PROMPT)
    assert 0 < len(turn) < len(prompt) and prompt[: len(turn)] == turn  # what every prompt starts with


@pytest.mark.parametrize("rule,expected", [
    ("none", [9]), ("all", list(range(10))), ("tail", [7, 8, 9]),
    ("deviation@1", [2, 5, 9]),  # the two largest before the last, then the last
])
def test_selections(rule, expected):
    deviation = {"deviation@1": torch.tensor([0.1, 0.0, 0.9, 0.2, 0.3, 0.8, 0.0, 0.1, 0.2, 5.0])}
    assert bench.select(rule, 0.3, 10, deviation) == expected


@pytest.mark.parametrize("rule,share,expected", [
    ("heads", 0.5, [0, 1, 3, 7, 9]),  # pieces of 3, 4, 3 tokens: their first tokens, then second ones
    ("heads", 0.3, [0, 3, 9]),
    ("heads+deviation@1", 0.5, [0, 2, 3, 7, 9]),  # 0, 3, 7 forced, then the largest deviation (2)
    ("heads+deviation@1", 0.2, [0, 9]),  # fewer slots than pieces: the first pieces' heads
])
def test_piece_head_selections(rule, share, expected):
    deviation = {"deviation@1": torch.tensor([0.1, 0.0, 0.9, 0.2, 0.3, 0.8, 0.0, 0.1, 0.2, 5.0])}
    assert bench.select(rule, share, 10, deviation, segments=[3, 4, 3]) == expected


def test_piece_heads_rows(tok_special, capsys):
    model = tiny_model(len(tok_special), seed=3)
    assert bench.report(model, tok_special, examples=2, shares=[0.5], tokens=4, piece_heads=True) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    variants = result["variants"]
    assert {"heads@0.5", "heads+deviation@1@0.5"} <= set(variants)
    rank = result["piece_heads_worst_rank"]["deviation@1"]
    assert rank >= 4 and any(f"among the block's {rank + 1} most deviating" in line for line in out)  # 5+ pieces
    assert variants["heads@0.5"]["recomputed_pct"] == variants["tail@0.5"]["recomputed_pct"]


def test_a_probe_layer_the_model_lacks_is_refused(tok_special):
    with pytest.raises(ValueError, match="the model has layers 0..1"):
        bench.report(tiny_model(len(tok_special)), tok_special, examples=1, shares=[0.5], tokens=4, probe_layers=(2,))


def test_document_piece_layouts():
    """``--doc-pieces``: the engine's pieces with their leads, the same without, or each document's
    number and text as one piece."""
    one = [7, 8, 9]
    case = cases.Case([1], list(range(20)), [4, 3, 5, 3, 2, 3], ["x"], 2, [[], [], one, [], one, []])
    assert cases.doc_pieces(case, "lead") == ([4, 3, 5, 3, 2, 3], [[], [], one, [], one, []])
    assert cases.doc_pieces(case, "alone") == ([4, 3, 5, 3, 2, 3], None)
    assert cases.doc_pieces(case, "line") == ([4, 8, 5, 3], None)
