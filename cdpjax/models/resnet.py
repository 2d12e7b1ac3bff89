def _none(): pass
