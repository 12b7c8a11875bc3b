from stand_in import names, unavailable

from torchvision.transforms import InterpolationMode

__getattr__ = names(
    "torchvision.transforms.functional",
    {
        "InterpolationMode": InterpolationMode,
        "pil_to_tensor": unavailable("torchvision.transforms.functional.pil_to_tensor"),
    },
)
