"""The experiment configs shipped with cdpjax, addressable by name: `--config digits:method=ppll`
runs `cdpjax/configs/digits.py`'s `get_config("method=ppll")` (`cdpjax.config.load_file`)."""
