from stand_in import names

__getattr__ = names("torchvision.transforms.v2.functional", {})  # imported as a module, no name read
