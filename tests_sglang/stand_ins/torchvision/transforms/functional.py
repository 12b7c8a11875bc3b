from stand_in import names, unavailable

import torchvision.transforms as _transforms

__getattr__ = names(
    "torchvision.transforms.functional",
    {
        "InterpolationMode": _transforms.InterpolationMode,
        "pil_to_tensor": unavailable("torchvision.transforms.functional.pil_to_tensor"),
    },
)
del _transforms  # every name is served (and logged) by __getattr__
