from stand_in import names

__version__ = "0.28.0"  # the release SGLang 0.5.23 pins; transformers compares it when torchvision imports
__getattr__ = names("torchvision", {})
