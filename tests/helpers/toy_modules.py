"""Small modules several test files build."""

from __future__ import annotations

from torch import nn


class SequenceFirst(nn.Module):
    """A Linear applied sequence-first ([B, T, d] -> [T, B, d] -> back): its examples lie along
    dimension 1 of the layer's input, which a per-example engine must refuse or handle."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.transpose(0, 1)).transpose(0, 1).mean(1)
