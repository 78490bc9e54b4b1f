"""A router in front of several engines; nothing inside radixserve imports it."""
