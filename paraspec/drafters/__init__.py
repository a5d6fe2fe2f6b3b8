"""Drafters: where the chain (`sd`) and tree (`tree`, `easyspec`) strategies get their draft tokens.

    base.py    the Drafter interface, Proposal, and the q contract (stated once, there)
    tree.py    TokenTree and draft_tree: growing a token tree from a drafter's logits
    model.py   ModelDrafter: a draft model (chains and trees; easyspec's fuzzy drafters subclass it)

A new drafter subclasses Drafter and implements propose(); strategies need no edit.
"""
from paraspec.drafters.base import Drafter, Proposal, point_mass
from paraspec.drafters.model import ModelDrafter
from paraspec.drafters.tree import TokenTree

__all__ = ["Drafter", "ModelDrafter", "Proposal", "TokenTree", "point_mass"]
