"""Generated protobuf and gRPC code for Laminar's control APIs.

Do not edit the ``*_pb2*.py`` files by hand: change the ``.proto`` files under
``packages/laminar-common/proto/`` and run ``tools/gen_proto.sh``, which pins
the generator so the output loads on protobuf >= 5.26.1 and grpcio >= 1.63.
"""
