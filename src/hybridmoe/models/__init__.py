"""The decoder shared by every model family (`decoder`), attention of each kind (`attention`), typed weight
access (`weight_loader`) and `loader.load_model`. What differs between families is described in
hybridmoe.config.families."""
