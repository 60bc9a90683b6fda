// Command etcd is the etcd server, built from go.etcd.io/etcd/server/v3 as a plain module
// dependency (the etcd repository's root module uses replace directives, so it cannot be
// `go install`ed directly).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
