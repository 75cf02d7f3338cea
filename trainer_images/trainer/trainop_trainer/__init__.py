"""ResNet image-classification trainer run by trainop jobs (`python -m trainop_trainer`)."""
