"""H-Spec drafter model, its ablations and the DFlash/DSpark baselines."""

from sglang_hspec.model.checkpoint import build_draft_vocab, build_drafter, load_drafter, save_drafter
from sglang_hspec.model.config import KINDS, SLOT_CONVENTION, HSpecConfig
from sglang_hspec.model.dflash import DFlashDraftModel, DFlashState
from sglang_hspec.model.hspec import DraftModel, DraftOutput

__all__ = ["KINDS", "SLOT_CONVENTION", "DFlashDraftModel", "DFlashState", "DraftModel", "DraftOutput",
           "HSpecConfig", "build_draft_vocab", "build_drafter", "load_drafter", "save_drafter"]
