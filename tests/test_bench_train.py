"""python -m flashattn.bench --train: the models, the providers swapped in, the rows."""
import json

import pytest
import torch

from flashattn import bench, bench_train
from flashattn.bench_train import QUICK, Stack, attention_provider

from conftest import DEVICE


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_flashattn_in_the_model_gives_torchs_loss_and_gradients(model):
    """The drop-in inside a real block stack (bshd views, GQA in the Llama-like one, rotary): the
    same loss and parameter gradients as with torch's SDPA, in float32."""
    m = QUICK[model]
    results = []
    for provider in ("flashattn", "torch-sdpa"):
        torch.manual_seed(0)
        net = Stack(m, attention_provider(provider)).to(DEVICE)
        torch.manual_seed(1)
        tokens = torch.randint(0, m.vocab, (m.batch, m.seq)).to(DEVICE)
        loss = net(tokens, torch.roll(tokens, -1, dims=1))
        loss.backward()
        results.append((loss.detach(), [p.grad.detach().clone() for p in net.parameters()]))
    (l1, g1), (l2, g2) = results
    assert torch.allclose(l1, l2, rtol=1e-5), (l1, l2)
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=2e-3, atol=2e-5), float((a - b).abs().max())


def test_a_quick_run_writes_rows_and_a_table(tmp_path):
    assert bench.main(["--train", "--quick", "--train-modes", "eager", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("train_*.json")
    record = json.loads(path.read_text())
    rows = record["results"]
    assert {"device", "torch", "triton"} <= set(record["environment"])
    assert {(r["model"], r["mode"]) for r in rows} == {("gpt2", "eager"), ("llama", "eager")}
    for r in rows:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and len(r["rounds_ms"]) >= 1


def test_speedups_and_table_read_the_rows():
    rows = [dict(model="gpt2", mode="eager", provider="flashattn", step_ms=10.0),
            dict(model="gpt2", mode="eager", provider="torch-sdpa", step_ms=12.0),
            dict(model="gpt2", mode="eager", provider="torch-sdpa-cudnn", step_ms=None, error="RuntimeError: no")]
    assert bench_train.speedups(rows) == {("gpt2", "eager"): pytest.approx(1.2)}
    table = bench_train.format_table(rows)
    assert "1.20x torch's" in table and "RuntimeError: no" in table


def test_an_unknown_provider_is_named():
    with pytest.raises(ValueError, match="provider must be one of"):
        attention_provider("xformers")
