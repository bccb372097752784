"""The MoE model layer on top of moe_ep.comm: the layer, its router, grouped and FP8 experts and their
kernels, the differentiable dispatch/combine (autograd, custom ops) and the overlap of the two."""
