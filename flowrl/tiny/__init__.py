"""The tiny procedural world and the tiny SD3-family model trained on it (see ``flowrl.tiny.build``)."""
