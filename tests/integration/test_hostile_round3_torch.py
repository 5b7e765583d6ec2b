"""The tests of tests/unit/test_hostile_round3.py that need torch or transformers."""
import pytest


def test_a_torch_mod_returning_another_shape_or_a_number_is_refused():
    torch = pytest.importorskip("torch")
    import qkv.torch as qt
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    with pytest.raises(ValueError, match=r"score_mod: expected <lambda> to return one score for each score .* got "
                                         r"\(1, 2, 64, 1\)"):
        qt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s.sum(-1, keepdim=True))
    with pytest.raises(TypeError, match="to return a torch tensor of scores .* got float"):
        qt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 1.5)
    same = qt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0 + torch.tensor(2.0))   # 0-d: all
    assert torch.allclose(same, qt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 0 + 2.0))


def test_a_captured_tensor_s_gradient_is_the_same_bits_run_after_run():
    """At two engine threads, the gradient of a captured bias table (a scatter-add in torch) was off in its last
    bits from run to run; torch's own threads now stay out of the workers' mod backward."""
    torch = pytest.importorskip("torch")
    import qkv
    import qkv.torch as qt
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1000, 32) for _ in range(3))
    bias = torch.randn(4, 2000, requires_grad=True)
    grads = []
    for _ in range(3):
        bias.grad = None
        qt.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias[h, i - j + 1000]).sum().backward()
        grads.append(bias.grad.clone())
    assert qkv.get_num_threads() == 2 or pytest.skip("needs two engine threads")
    assert all(torch.equal(grads[0], g) for g in grads[1:])
