"""Teaching a model the retrieve markers: supervised traces (``data``) and LoRA training (``lora``)."""
