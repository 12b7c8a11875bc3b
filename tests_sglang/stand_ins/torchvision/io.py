from enum import Enum

from stand_in import names, unavailable


class ImageReadMode(Enum):  # torchvision's values
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


__getattr__ = names(
    "torchvision.io", {"ImageReadMode": ImageReadMode, "decode_image": unavailable("torchvision.io.decode_image")}
)
del ImageReadMode  # served (and logged) by __getattr__
