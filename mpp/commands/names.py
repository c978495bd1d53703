"""The names of mpp's commands and what each does: what the console script dispatches on
(mpp.commands) and what `mpp --help` lists (mpp.console). It imports nothing, so both can read it."""

# The Lightning runs, as LightningCLI names them (mpp.cli), and what each does.
RUN_COMMANDS = {
    "fit": "train a module (pretraining, fine-tuning, from scratch) as a config says",
    "validate": "a checkpoint's metrics on the validation shards",
    "test": "a checkpoint's metrics on the test shards",
    "predict": "every sample's key and the encoder's features or the classifier's prediction, as .npy",
}

# name -> (module, what it does), in the order `mpp --help` lists them.
COMMANDS = {
    "shards": ("mpp.commands.shards", "write shards from images (write), or check shards (inspect)"),
    "export": ("mpp.commands.export", "a checkpoint's encoder for timm or Hugging Face transformers"),
    "evaluate": ("mpp.commands.evaluate", "few-shot, k-NN and linear-probe accuracy of a frozen encoder"),
    "analyse": ("mpp.commands.analyse", "the ViT paper's Figure 7 analyses of encoders, as pictures"),
}
