"""datasets.formatting.formatting.LazyRow, imported by llm-compressor's dataset registry."""


class LazyRow(dict):
    pass
