"""The policy arena: a student's scheduling policy scored against the built-ins (score,
python -m demos.arena), on workloads (workloads), simulated (sim), reported (report); example policies in policies/."""
