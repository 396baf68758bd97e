"""The RabbitMQ side: connections to a list of brokers, queue declarations,
publishing with pipelined confirms, and finding which message a broker
refused.

It sends ``drain.broker.outgoing.Message`` (bytes and AMQP properties with a
row id) and knows nothing of Celery's protocol. May import ``drain.settings``
and the foundation; never Postgres, Celery, daemon or CLI.
"""
