"""``hydra/launcher=kdsweep_pack``: a grid's jobs trained as one packed job in this process (logic in kdsweep.pack)."""
