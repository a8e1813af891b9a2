"""`llmgw node`: the agent that runs replicas on one machine.

Level-triggered: every heartbeat reports the machine's capacity and its replicas' states, and
the answer is the complete list of replicas to run; the agent starts what is missing and stops
what is no longer listed, so a lost message changes nothing. Engines outlive the agent, which
adopts them when it starts again. This package must not import Django.
"""
