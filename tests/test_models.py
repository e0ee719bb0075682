import dataclasses

import pytest
import torch

from mobius.boundary.errors import InputError
from mobius.models import PRESETS, build_layer, build_model, get_config, layer_count


def test_layer_list_in_sequence_equals_model_forward_bitwise():
    cfg = get_config("tiny")
    model = build_model(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.randint(0, cfg.vocab_size, (2, 16))
    x = tokens
    for layer in model.layers[:-1]:
        x = layer(x)
    by_layers = model.layers[-1](x, targets)
    assert torch.equal(by_layers, model(tokens, targets))


def test_layers_built_alone_equal_layers_built_together_on_threads():
    """The model's layers are drawn on several threads at once (two here), each from its own seed:
    the same values as each layer built alone, the seed's own draws, and the global stream untouched."""
    cfg = dataclasses.replace(get_config("tiny"), tie_embeddings=True)
    rng = torch.random.get_rng_state()
    model = build_model(cfg, seed=5)
    assert torch.equal(torch.random.get_rng_state(), rng)
    for i in range(layer_count(cfg)):
        alone = build_layer(cfg, i, seed=5)
        for (n1, p1), (n2, p2) in zip(model.layers[i].named_parameters(), alone.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)
    table = model.layers[0].wte.weight
    drawn = torch.empty_like(table).normal_(0, 0.02, generator=torch.Generator().manual_seed(5 * 100_003))
    assert torch.equal(table, drawn) and torch.equal(model.layers[-1].lm_head.weight, drawn)


@pytest.mark.parametrize("name", ["mobius-3b", "mobius-8b", "mobius-15b", "mobius-51b"])
def test_mobius_presets_are_12_l_h2_plus_embeddings(name):
    c = get_config(name)
    n = build_model(c, device="meta").num_parameters()
    blocks = 12 * c.n_layer * c.hidden**2
    embeddings = c.vocab_size * c.hidden + c.context * c.hidden  # token + position tables
    head = c.vocab_size * c.hidden  # untied LM head
    norms = (2 * c.n_layer + 1) * c.hidden  # LayerNorm weights, no biases
    assert n == blocks + embeddings + head + norms


def test_mobius_15b_is_about_12_6b_as_documented():
    n = build_model(get_config("mobius-15b"), device="meta").num_parameters()
    assert 12.5e9 < n < 13.2e9


@pytest.mark.parametrize("name,published", [("gpt2", 124e6), ("gpt2-medium", 355e6),
                                            ("gpt2-large", 774e6), ("gpt2-xl", 1.56e9)])
def test_gpt2_sizes_match_published(name, published):
    n = build_model(get_config(name), device="meta").num_parameters()
    assert abs(n - published) / published < 0.01


def test_layer_costs_without_running():
    c = get_config("mobius-3b")
    model = build_model(c, device="meta")
    block = model.layers[1]
    assert block.param_bytes(torch.float16) == 2 * 12 * c.hidden**2 + 2 * 2 * c.hidden
    assert block.output_bytes(2, 512, torch.float16) == 2 * 512 * c.hidden * 2
    assert block.forward_flops(2, 512) == 24 * 2 * 512 * c.hidden**2 + 4 * 2 * 512 * 512 * c.hidden
    assert model.layers[-1].output_bytes(2, 512) == 4


def test_tied_gpt2_shares_one_parameter_and_sums_its_gradient():
    c = get_config("gpt2")
    import dataclasses
    small = dataclasses.replace(c, n_layer=1, hidden=32, heads=2, vocab_size=100, context=16)
    model = build_model(small, seed=0)
    assert model.layers[-1].lm_head.weight is model.layers[0].wte.weight
    tokens = torch.randint(0, 100, (1, 8))
    model(tokens, tokens).backward()
    wte = model.layers[0].wte.weight
    # The gradient has both contributions: the head's is dense, the embedding's only on used rows.
    unused = torch.ones(100, dtype=torch.bool)
    unused[tokens.unique()] = False
    assert wte.grad[unused].abs().sum() > 0 and wte.grad[~unused].abs().sum() > 0


def test_plan_only_preset_refuses_to_run():
    with pytest.raises(InputError, match="not divisible"):
        build_layer(get_config("mobius-51b"), 1, seed=0)


def test_unknown_preset():
    with pytest.raises(InputError, match="unknown model preset"):
        get_config("gpt5")
    assert "tiny" in PRESETS


@pytest.mark.parametrize("chunk,softcap", [(1, None), (5, None), (64, None), (5, 0.7)])
def test_chunked_cross_entropy_equals_the_full_logits_one(chunk, softcap):
    """The head's loss and gradients without the full logits equal F.cross_entropy over them
    (soft-capped logits too: Gemma 2)."""
    import torch.nn.functional as F

    from mobius.models.gpt import ChunkedCrossEntropy, WeightGradSum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    logits = h @ w.t()
    full = F.cross_entropy(logits if softcap is None else torch.tanh(logits / softcap) * softcap, t)
    gh, gw = torch.autograd.grad(full, (h, w))
    chunked = ChunkedCrossEntropy.apply(h, w, t, chunk, True, WeightGradSum(), 37, softcap)
    ch, cw = torch.autograd.grad(chunked, (h, w))
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=0)
    torch.testing.assert_close(ch, gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(cw, gw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("order", ["pipeline", "alternating"])
def test_the_heads_weight_gradient_is_one_sum_over_the_micro_batches(order):
    """The pipeline runs every micro-batch's forward before any backward: the head then holds one
    fp32 sum of its weight's gradient (saved once), not one per micro-batch, and the step's
    gradient is autograd's over the micro-batches whichever order they run in."""
    from mobius.models import TokenLayout
    from mobius.models.gpt import Head

    head = Head(get_config("tiny"))
    xs = [torch.randn(2, 9, head.config.hidden, requires_grad=True) for _ in range(3)]
    targets = [torch.randint(0, head.config.vocab_size, (2, 9)) for _ in range(3)]
    want = sum(torch.autograd.grad(torch.nn.functional.cross_entropy(head.logits(x).flatten(0, 1), t.flatten(),
                                                                     reduction="sum") / 54, head.lm_head.weight)[0]
               for x, t in zip(xs, targets))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        if order == "pipeline":
            losses = [head(x, TokenLayout(targets=t, loss_tokens=54)) for x, t in zip(xs, targets)]
            held = [n for n in saved if n == head.lm_head.weight.numel()]
            assert len(held) == 1  # one sum for the three micro-batches
            for loss in reversed(losses):
                loss.backward()
        else:
            for x, t in zip(xs, targets):
                head(x, TokenLayout(targets=t, loss_tokens=54)).backward()
    torch.testing.assert_close(head.lm_head.weight.grad, want, rtol=1e-5, atol=1e-7)
    assert head.weight_grads.total is None  # taken: the next step starts from nothing


def test_head_loss_is_the_trained_tokens_sum_over_the_steps_count():
    """IGNORE targets carry no loss and no gradient; the sum is divided by the step's trained tokens."""
    import torch.nn.functional as F

    from mobius.models import IGNORE, TokenLayout, get_config
    from mobius.models.gpt import Head

    head = Head(get_config("tiny"))
    x = torch.randn(2, 9, head.config.hidden, requires_grad=True)
    targets = torch.randint(0, head.config.vocab_size, (2, 9))
    targets[0, :4] = IGNORE
    targets[1, 7:] = IGNORE
    loss = head(x, TokenLayout(targets=targets, loss_tokens=40))
    logits = head.logits(x).reshape(-1, head.config.vocab_size)
    expect = F.cross_entropy(logits, targets.reshape(-1), ignore_index=IGNORE, reduction="sum") / 40
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=0)
    (g,) = torch.autograd.grad(loss, x)
    (ge,) = torch.autograd.grad(expect, x)
    torch.testing.assert_close(g, ge, rtol=1e-5, atol=1e-8)
    assert g[0, :4].abs().max() == 0
