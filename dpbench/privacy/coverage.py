"""The book-keeping and ghost engines' coverage check (bookkeeping.py): once per engine, autograd's
summed gradient is compared with the sum of what the layer hooks saw, so a parameter whose gradient
has a part no hook saw is refused in one line before any release (no per-example norm would cover
that part). It reads the engine's state (its parameters, the pieces' sums and squared norms of the
backward just run) and marks the engine checked."""

from __future__ import annotations

import torch

from dpbench.errors import UserError


def check_coverage(engine) -> None:
    """Refuse a trainable parameter whose gradient has a part no hook saw (a parameter read
    outside its module's forward, e.g. by a parent module): no per-example norm would cover
    that part. Compares autograd's summed gradient with the sum of the hooks' pieces, once."""
    if engine._canonical is not None:
        return _check_sharded_coverage(engine)
    uncovered = []
    names = {p: n for n, p in engine.model.named_parameters()}
    maps = {p: o for m, o in engine.overrides.items() if hasattr(o, "map_gradient") for p in m.parameters()}
    grads = [p.grad for p in engine.params if p.grad is not None]
    if not all(bool(torch.isfinite(g).all()) for g in grads):
        engine._state.summed.clear()
        return  # a non-finite example: compare on a later call
    # Rounding is measured against what was summed, not against the sum: a parameter whose
    # examples' gradients cancel (a LayerNorm weight under bf16) is
    # compared at the tolerance times Σ_i ‖G_i‖, and one whose gradient is zero in exact
    # arithmetic (an attention key's bias: the softmax ignores it), rounding noise in both
    # sums, against the whole gradient at a thousandth of the tolerance.
    floor = 1e-3 * engine.tolerance * float(torch.stack([g.float().norm() for g in grads]).norm()) if grads else 0.0
    for p in engine.params:
        seen = engine._state.summed.get(p)
        grad = p.grad
        if grad is None:
            continue
        grad = maps[p].map_gradient(p, grad.float()) if p in maps else grad.float()
        if seen is None:
            missing = grad.norm()
        else:
            missing = (grad - seen).norm() if seen.shape == grad.shape else torch.tensor(0.0)
        summed = engine._state.norm_sq[p].sqrt().sum().item() if p in engine._state.norm_sq else 0.0
        if missing.item() > engine.tolerance * max(grad.norm().item(), summed) + floor + 1e-7:
            uncovered.append(names.get(p, "?"))
    engine._state.summed.clear()
    engine._coverage_checked = True
    if uncovered:
        mode = "bk" if engine.passes == 1 else "ghost"
        raise UserError(
            f"algo.per_sample={mode}: the gradient of {', '.join(uncovered[:5])} is not (only) what its module's "
            "forward output received (the parameter is read outside that forward, or a view of the output "
            "is changed in place), so no per-example norm would cover it; use algo.per_sample=materialize "
            "or keep the parameter and the output inside the module"
        )

def _check_sharded_coverage(engine) -> None:
    """`check_coverage` for a sharded model: FSDP2 reduce-scattered autograd's gradient as a
    SUM over the ranks (dpbench/runtime/sharding.py), so each rank compares its shard of it with its
    shard of the hooks' sums reduce-scattered alike; the ranks add up the squared differences
    and norms and decide together (a lone refusal would leave the others in a collective)."""
    from dpbench.runtime import distributed

    state, names = engine._state, {p: n for n, p in engine.model.named_parameters()}
    maps = {p: o for m, o in engine.overrides.items() if hasattr(o, "map_gradient") for p in m.parameters()}
    grads = [None if p.grad is None else p.grad.to_local().float() for p in engine.params]
    (nonfinite,) = distributed.all_reduce_scalars(
        float(not all(bool(torch.isfinite(g).all()) for g in grads if g is not None)))
    if nonfinite:
        state.summed.clear()
        return  # a non-finite example on some rank: compare on a later call
    rows = []
    for p, grad in zip(engine.params, grads):
        seen, shape = state.summed.get(p), p.shape
        if p in maps and grad is not None:  # the hooks sum a map of the gradient (DP-GRAPE's projection):
            # map autograd's whole gradient (gathered: a collective, alike on every rank, the same
            # parameters in the same order) and compare this rank's rows of it
            mapped = maps[p].map_gradient(p, p.grad.full_tensor().float())
            grad, shape = mapped[distributed.row_shard(mapped.shape[0])], mapped.shape
        seen = torch.zeros(shape, dtype=torch.float32, device=p.device) if seen is None else seen.float().clone()
        seen = distributed.reduce_scatter_rows(seen)
        grad = torch.zeros_like(seen) if grad is None else grad
        summed = state.norm_sq[p].sqrt().sum().double() if p in state.norm_sq else torch.zeros((), dtype=torch.float64)
        rows.append(torch.stack([((grad - seen).double() ** 2).sum(), (grad.double() ** 2).sum(), summed,
                                 torch.tensor(float(p.grad is not None), dtype=torch.float64)]))
    table = torch.stack(rows) if rows else torch.zeros((0, 4), dtype=torch.float64)
    distributed.all_reduce_sum([table])
    floor = 1e-3 * engine.tolerance * float(table[:, 1].sum().sqrt())
    uncovered = [names.get(p, "?") for p, (missing_sq, grad_sq, summed, has_grad) in zip(engine.params, table.tolist())
                 if has_grad and missing_sq ** 0.5 > engine.tolerance * max(grad_sq ** 0.5, summed) + floor + 1e-7]
    state.summed.clear()
    engine._coverage_checked = True
    if uncovered:
        raise UserError(
            f"algo.per_sample={'bk' if engine.passes == 1 else 'ghost'}: the gradient of {', '.join(uncovered[:5])} "
            "is not (only) what its module's forward output received, so no per-example norm would cover it; "
            "use train.sharding=none with algo.per_sample=materialize"
        )
