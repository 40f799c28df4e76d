"""kvcache."""
