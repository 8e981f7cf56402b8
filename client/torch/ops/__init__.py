"""The offloaded normalizations as torch.library custom ops with autograd, one module each: the forward
runs aten's kernel here, the backward the aclnn operator through the client."""
