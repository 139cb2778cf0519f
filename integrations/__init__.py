"""Record sources outside batchscope's own engine: adapters that make another serving engine publish
batchscope's StepRecords (engine/outputs/records.py), so the same page draws it. Each subpackage imports
only where its engine is installed."""
