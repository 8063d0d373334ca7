"""A stand-in for Hugging Face `datasets`, put on PYTHONPATH by examples/bench/peers.sh only when
the real package cannot be imported on the GPU machine (it needs pyarrow, too large to carry).

llm-compressor imports `datasets` at module level (typing, its dataset registry) but, given a
torch DataLoader as `dataset`, never calls it: oneshot returns the DataLoader as is
(llmcompressor.datasets.utils.get_calibration_dataloader). AutoRound (optional) imports more
names at module level (auto_round/calib_dataset.py) and, given a list of token tensors, uses
none of them either. These names only let those imports and isinstance checks run; anything
that would really use them raises.
"""

__version__ = "0.0.0-peers-shim"
SHIM = True


class _Unavailable:
    def __init__(self, *a, **k):
        raise RuntimeError("datasets shim (examples/bench/peers/shims): the real `datasets` is not installed")


class Dataset(_Unavailable):
    pass


class IterableDataset(_Unavailable):
    pass


class DatasetDict(dict):
    pass


class IterableDatasetDict(dict):
    pass


class Features(dict):
    pass


class Value:
    def __init__(self, *a, **k):
        pass


class Sequence:
    def __init__(self, *a, **k):
        pass


def concatenate_datasets(*a, **k):
    raise RuntimeError("datasets shim: concatenate_datasets is not available")


def load_dataset(*a, **k):
    raise RuntimeError("datasets shim: load_dataset is not available (no network, no pyarrow)")


def load_from_disk(*a, **k):
    raise RuntimeError("datasets shim: load_from_disk is not available")
