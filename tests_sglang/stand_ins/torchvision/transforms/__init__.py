from enum import Enum

from stand_in import names


class InterpolationMode(Enum):  # torchvision's values: transformers reads them when it defines its defaults
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = names("torchvision.transforms", {"InterpolationMode": InterpolationMode})
del InterpolationMode  # served (and logged) by __getattr__
