"""Processors vlmrl supplies where transformers' own cannot load here: image-only stand-ins for processors whose video
half needs torchvision (not usable beside the CPU torch); a saved folder still names the real class."""
