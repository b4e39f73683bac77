"""--offload-train: storages released to zero bytes and restored bit-exactly, views kept valid."""

import torch

from slime.backends.megatron.offload import Offloader


class _GradBuffer:
    def __init__(self, params):
        n = sum(p.numel() for p in params)
        self.grad_data = torch.zeros(n)
        off = 0
        for p in params:  # main_grad views into one flat buffer, as Megatron DDP does
            p.main_grad = self.grad_data[off:off + p.numel()].view_as(p)
            off += p.numel()


def test_offload_onload_roundtrip():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    model.buffers = [_GradBuffer(list(model.parameters()))]
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = [v.clone() for s in opt.state.values() for v in s.values() if v.dim() > 0]
    for p in model.parameters():
        p.main_grad.fill_(3.0)
    off = Offloader(model, opt)
    released = off.offload()
    assert released >= sum(p.numel() * 4 for p in model.parameters()) * 4  # params, exp_avg, exp_avg_sq, grads
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert model.buffers[0].grad_data.untyped_storage().nbytes() == 0
    assert off.offload() == 0  # idempotent
    off.onload()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
        assert (p.main_grad == 0).all()  # grads are not kept, the buffer comes back zeroed
    state_after = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]
    assert all(torch.equal(a, b) for a, b in zip(state_after, state_before))
    p0 = next(model.parameters())
    p0.main_grad.fill_(1.0)  # the view still aliases the restored buffer
    assert model.buffers[0].grad_data[: p0.numel()].eq(1.0).all()
    model(torch.randn(2, 5)).sum().backward()
    opt.step()  # the optimizer still works on restored storages
