"""An evaluation loader with scripted losses, shared by the Trainer tests."""

import numpy as np


class Scripted:
    """An evaluation Loader whose i-th pass yields loss values[i]."""

    def __init__(self, values):
        self.values, self.i = list(values), 0

    def __iter__(self):
        v = self.values[self.i]
        self.i += 1
        yield {"v": np.full(1, v, np.float32)}

    def __len__(self):
        return 1

    def set_epoch(self, epoch):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
