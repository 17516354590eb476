"""Ground floor shared by drafters (sglang_hspec.model), the reference engine and the SGLang worker:
the drafter/engine contract (types.py) and the sampling transforms both sides of a verify must apply
(sampling.py). It imports only torch and sglang_hspec.target, so model never needs engine."""
