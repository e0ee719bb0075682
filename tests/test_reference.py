import torch

from mobius.config import RunConfig
from mobius.data import BatchSource, load_corpus
from mobius.models import build_model, get_config
from mobius.reference import ReferenceTrainer


def test_accumulating_micro_batches_equals_one_big_batch():
    """M micro-batches of size B give the gradient of one batch of M*B (fp32, rtol 1e-5):
    the mean over micro-batch means equals the mean over all tokens when they are equal-sized."""
    cfg = get_config("tiny")
    corpus = load_corpus(None, max_bytes=100_000)
    micro = BatchSource(corpus, 32, 2, 4, seed=1).step(0)
    acc = build_model(cfg, seed=0)
    for mb in micro:
        (acc(mb.tokens, mb.targets) / len(micro)).backward()
    big = build_model(cfg, seed=0)
    tokens = torch.cat([mb.tokens for mb in micro])
    targets = torch.cat([mb.targets for mb in micro])
    big(tokens, targets).backward()
    for p, q in zip(acc.parameters(), big.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_reference_trainer_loss_falls_and_is_deterministic():
    def run():
        cfg = RunConfig.of(model="tiny", steps=8, micro_batch_size=2, micro_batches=2, seq_len=32, lr=3e-3,
                           precision="fp32")
        batches = BatchSource(load_corpus(None, max_bytes=100_000), 32, 2, 2, cfg.optim.seed)
        t = ReferenceTrainer(cfg, get_config("tiny"), batches, torch.device("cpu"))
        return [t.step(k).loss for k in range(cfg.optim.steps)]

    a, b = run(), run()
    assert a == b
    assert a[-1] < a[0] - 0.5


def test_single_backend_writes_its_trace(tmp_path):
    import json

    from mobius.train import main

    trace = tmp_path / "t.json"
    main(["--model", "tiny", "--backend", "single", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2",
          "--no-progress", "--trace", str(trace)])
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"fwd mb0", "bwd mb3", "AdamW"} <= names and all(e["dur"] >= 0 for e in events)
