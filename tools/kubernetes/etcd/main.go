// etcd, the API server's store: the same entry point as etcd's own main package (go.etcd.io/etcd/v3),
// built at the etcd version this Kubernetes release requires.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
