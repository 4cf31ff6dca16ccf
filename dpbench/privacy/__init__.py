"""Privacy machinery shared by every private algorithm: per-sample gradients, clipping and
noise, Poisson sampling and the accountants that turn a ledger of mechanisms into epsilon."""
