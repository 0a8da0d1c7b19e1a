"""A Lightning module that whitens its embeddings with batch statistics (a VICReg-style
regularizer): the last batch holds a single sample, and its unbiased std divides by n - 1 = 0."""

import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Whitened(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        z = self.encoder(x)
        z = (z - z.mean(0)) / (z.std(0) + 1e-4)  # nanpass-expect: birth
        return F.mse_loss(z.sum(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


torch.manual_seed(0)
data = TensorDataset(torch.randn(7, 8), torch.randn(7))
model = Whitened()
trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(data, batch_size=2))

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
