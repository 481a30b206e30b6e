"""dflash-doctor: diagnostics for speculative decoding (DFlash block-diffusion and autoregressive drafts)."""

__version__ = "0.1.0"
